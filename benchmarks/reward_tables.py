"""How many rows of the reward tables the installed rewards get right (tests/math_answer_table.py,
tests/code_program_table.py), and the math reward against Math-Verify's own test cases.

    python benchmarks/reward_tables.py                                   # this checkout
    PYTHONPATH=/path/to/other/checkout/src python benchmarks/reward_tables.py   # e.g. main, for a before/after
    python benchmarks/reward_tables.py --only math-verify                # the Math-Verify table alone (< 1 min)

Prints one line per table and the rows that are wrong (the expected values are the tables' own).

The Math-Verify table: the (gold, prediction, expected) cases of the parametrised tests of huggingface/Math-Verify
(``tests/``, main in December 2026, MIT licence) whose gold and prediction are at most 100 characters, written out
below as data; ``setting`` names a non-default option of theirs the case runs under. Ours: ``math_reward`` on the
prediction as the completion (wrapped in ``\\boxed{}`` when it has no box: our reward reads the last box only), the
case's gold as the gold. Every disagreement with their expected value has a class in ``DISAGREEMENTS``; one without
a class is printed as ``unclassified`` (the table fails its own check).
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))

# (their test's group, gold, prediction, their expected score, their non-default setting)
MATH_VERIFY_CASES = [
    ('number_extraction', '-5', '-5', 1, ''),
    ('number_extraction', '7425000', '7,425,000', 1, ''),
    ('number_extraction', '1000', '1 000', 1, ''),
    ('number_extraction', '1000', '1000.0', 1, ''),
    ('number_extraction', '1000.0', '1,000.0', 1, ''),
    ('number_extraction', '1000.99', '1000,99', 1, ''),
    ('number_extraction', '1,22', '1.22', 1, ''),
    ('number_extraction', '2.74', 'Soucis : 2,74 $ a..', 1, ''),
    ('number_extraction', '0.4', '.4', 1, ''),
    ('number_extraction', '1000.99', '1,000.99', 1, ''),
    ('number_extraction', '1000.99', '1,000.99', 1, ''),
    ('number_extraction', '1000.99', '$1,000.99', 1, ''),
    ('number_extraction', '1000.99', '1,000.99$', 1, ''),
    ('number_extraction', '1000.99', 'the number is not 10 which is 1,000.99€', 1, ''),
    ('number_extraction', '1000.99', 'the number is not 10 which is 1,000.99€', 1, ''),
    ('number_extraction', '1000.99', 'so the number is 10 which is 1,000.99m²', 1, ''),
    ('number_extraction', '1000.99', "not it's not 10 it's 1,000.99m²", 1, ''),
    ('number_extraction', '0,111', '0.111', 1, ''),
    ('number_extraction', '2', 'AZYUK2A', 0, ''),
    ('simple_fraction_notation', '10/9', '\\frac{10}{9}', 1, ''),
    ('simple_fraction_notation', '-10/9', '-\\frac{10}{9}', 1, ''),
    ('sets_handling', '$[0,1)$', '$[0,1)$', 1, ''),
    ('sets_handling', '$[0,1)$', '$[0,1)$', 1, ''),
    ('sets_handling', '$[0,9)$', '$[0,1)$', 0, ''),
    ('sets_handling', '$(0,9)$', '$[0,9)$', 0, ''),
    ('sets_handling', '$1$', '$-[0,1)$', 0, ''),
    ('latex_notation', '$9$', 'Answer \\[ 9 \\]', 1, ''),
    ('latex_notation', '$9$', 'Answer $ 9 $', 1, ''),
    ('latex_notation', '$9$', 'Answer $$ 9 $$', 1, ''),
    ('latex_notation', '$9$', 'Answer \\( 9 \\)', 1, ''),
    ('latex_notation', '$10$', 'Answer \\( (9+1) \\)', 1, ''),
    ('latex_notation', '$9$', 'Answer $ \n 9 \n $', 0, ''),
    ('latex_notation', '$9$', 'Answer \\( \n 9 \n \\)', 0, ''),
    ('latex_notation', '$9$', 'Answer \\[ \n 9 \n \\]', 1, ''),
    ('latex_notation', '$9$', 'Answer $$ \n 9 \n $$', 1, ''),
    ('latex_notation', '$10/9$', 'Answer $ \\frac{1}{2} \\$ = \\frac{10}{9} $', 1, ''),
    ('latex_notation', '$1/3$', '$\\frac13 $', 1, ''),
    ('latex_notation', '$1$', '$\\frac3{3} $', 1, ''),
    ('latex_notation', '$\\sqrt{3}$', '$\\sqrt3 $', 1, ''),
    ('latex_notation', '$1/3$', '$\\cfrac{1}{3} $', 1, ''),
    ('latex_notation', '$1/3$', '$\\dfrac{1}{3} $', 1, ''),
    ('latex_notation', '$1/3$', '$\\tfrac{1}{3} $', 1, ''),
    ('latex_notation', '$1/3$', '$ 1/3 $', 1, ''),
    ('latex_notation', '$1/3$', '$\\left( \\frac{1}{3} \\right)$', 1, ''),
    ('latex_notation', '$1/3$', '$\\boxed{\\frac{1}{3}}$', 1, ''),
    ('latex_notation', '$1/3$', '$\\frac{1}{3} \\text{meters}$', 1, ''),
    ('latex_notation', '$1/3$', '$\\frac{1}{3} \\textbf{meters}$', 1, ''),
    ('latex_notation', '$1/3$', '$k = \\frac{1}{3}$', 1, ''),
    ('latex_notation', '$1/3$', '$\\frac{1}{3} \\textbf{meters}$', 1, ''),
    ('percent_notation', '$28\\%$', '28 percent', 1, ''),
    ('percent_notation', '$28\\%$', '28 pct', 1, ''),
    ('percent_notation', '$28\\%$', '28 %', 1, ''),
    ('percent_notation', '$28\\%$', '$28$ %', 1, ''),
    ('percent_notation', '$28\\%$', '$28$ percent', 1, ''),
    ('percent_notation', '$28\\%$', '$\\boxed{28}$ pct', 1, ''),
    ('percent_notation', '$28\\%$', '$\\boxed{28 pct}', 1, ''),
    ('percent_notation', '$28\\%$', '$\\boxed{28 percent}', 1, ''),
    ('percent_notation', '$28\\%$', '$\\boxed{28 percentage}', 1, ''),
    ('latex_notation_math', '$2-2p$', 'Since $x<2$, it follows that $|x-2|=2-x$. If $2-x=p$, then $x=2-p$. Thus $x-p=\\boxed{2-2p}$.', 1, ''),
    ('latex_notation_math', '\\boxed{\n\\begin{pmatrix} 0 & 3 \\\\ 0 & -1 \\end{pmatrix}\n}.\n\\end{align*}', '\\boxed{\n\\begin{pmatrix} 0 & 3 \\\\ 0 & -1 \\end{pmatrix}\n}.\n\\end{align*}', 1, ''),
    ('latex_notation_math', '$\\{1\\pm\\sqrt{5},-2\\}$', 'The roots of $P(x)$ are $-2$ and $1 \\pm \\sqrt{5}$, so the answer is $\\boxed{\\{1\\pm\\sqrt{5},-2\\}}.$', 1, ''),
    ('latex_notation_math', '$2 \\sin b \\cos a$', 'By sum-to-product,\n\\[\\sin (a + b) - \\sin (a - b) = \\boxed{2 \\sin b \\cos a}.\\]', 1, ''),
    ('latex_notation_math', '$125$ miles', 'The distance is $\\boxed{125\\textnormal{ miles}}.$', 1, ''),
    ('latex_notation_math', '$[-1, -\\frac{1}{2}) \\cup (-\\frac{1}{2}, 0) \\cup (0, 1) \\cup (1, \\infty)$', 'The solution set is $\\boxed{[-1, -\\tfrac12) \\cup (-\\tfrac12, 0) \\cup (0, 1) \\cup (1, \\infty)}.$', 1, ''),
    ('latex_notation_math', '$\\sqrt{2}+\\sqrt{5}$', 'The answer is $\\boxed{\\sqrt 2+\\sqrt 5}$', 1, ''),
    ('latex_notation_math', '$\\frac{9}{4}\\pi$', 'Therefore $\\boxed{\\frac94\\pi}$.', 1, ''),
    ('latex_notation_math', 'x \\in \\boxed{\\{-1\\} \\cup [0,7)}.$', 'x \\in \\boxed{\\{-1\\} \\cup [0,7)}.$', 1, ''),
    ('relations_math', '$x >= 5$', 'Therefore $x \\geq 5$ is the solution.', 1, ''),
    ('relations_math', '$x < 3$', 'We find that $x \\lt 3$.', 1, ''),
    ('relations_math', '$x \\leq 2$', 'Thus $x <= 2$ is our answer.', 1, ''),
    ('relations_math', '$x > 5$', 'Therefore $x \\gt 5$ is the solution.', 1, ''),
    ('relations_math', '$x != 3$', 'We find that $x \\neq 3$.', 1, ''),
    ('relations_math', '$x > 5$', 'Therefore $x < 5$ is the solution.', 0, ''),
    ('relations_math', '$x \\geq 5$', 'The solution is $x \\leq 5$', 0, ''),
    ('relations_math', '$x \\neq 5$', 'The solution is $x != 5$', 1, ''),
    ('relations_math', '$x \\leq 5$', '$5 \\geq x$', 1, ''),
    ('relations_math', '$x \\geq 5$', '$5 \\leq x$', 1, ''),
    ('relations_math', '$x = 11$', '$x = 5+5+1 = 7 =11$', 1, ''),
    ('relations_math', '$7 = 11a+c$', '$11a+c$', 0, ''),
    ('relations_math', '$x = 11$', '$x = 5+5+1 = 7 =11$', 1, ''),
    ('relations_math', '$x = 1/3$', '$x = 5+5+1 = 1/3 \\approx 11$', 1, ''),
    ('relations_math', '$11$', '$x=11$', 1, ''),
    ('relations_math', '$11$', '$x\\approx11$', 1, ''),
    ('relations_math', '$1/3$', '$x=1/3\\approx1.3$', 1, ''),
    ('relations_math', '$x < 1$', '$-x > -1$', 1, ''),
    ('relations_math', '$x < 1$', '$x > -1$', 0, ''),
    ('relations_math', '$x <= 1$', '$-x >= -1$', 1, ''),
    ('relations_math', '$a +3z = 0$', '$0$', 0, ''),
    ('relations_math', '$1 = \\zzz = x = 0$', '$0$', 1, ''),
    ('relations_math', '$2x + z = 1$', '$1$', 0, ''),
    ('relations_math', '$a^2 + b = 0$', '$0$', 0, ''),
    ('relations_math', '$k=1$', '$1$', 1, ''),
    ('relations_math', '$1$', '$k=1$', 1, ''),
    ('relations_math', '$z = 1 + 1 = 2$', '$z = 3+3 = 2$', 1, ''),
    ('relations_math', '$z = 1 + 1 = 2$', '$z = 3+3 = 2$', 1, ''),
    ('relations_math', '$2x+4y-3=0$', '$y=-\\frac{1}{2}x+\\frac{3}{4}$', 1, ''),
    ('relations_math', '$x^2/4 + y^2/3 = 1$', '$x^2/16 + y^2/12 = 1/4$', 1, ''),
    ('matrix_extraction', '$\\begin{pmatrix}1 & 0 \\\\ 0 & 1\\end{pmatrix}$', 'The identity matrix is $ \\begin{pmatrix}1 & 0 \\\\ 0 & 1\\end{pmatrix} $.', 1, ''),
    ('matrix_extraction', '$\\begin{bmatrix}0 & 0 \\\\0 & 0\\end{bmatrix}$', 'Here is a zero matrix: $ \\begin{pmatrix}0 & 0 \\\\0 & 0\\end{pmatrix} $', 1, ''),
    ('matrix_extraction', '$\\begin{pmatrix}1 & 2 \\\\3 & 4\\end{pmatrix}$', 'Special matrix: $ \\left[\\begin{array}{cc}1 & 2 \\\\3 & 4\\end{array}\\right] $', 1, ''),
    ('matrix_extraction', '$\\begin{pmatrix}6 & 8 \\\\ 10 & 12\\end{pmatrix}$', 'The sum is $\\begin{pmatrix}1 & 2 \\\\ 3 & 4\\end{pmatrix} + \\begin{pmatrix}5 & 6 \\\\ 7 & 8\\end{pmatrix}$', 1, ''),
    ('matrix_extraction', '$\\begin{pmatrix}1 & 2 \\\\ 3 & 4\\end{pmatrix}$', 'The matrix is $\\begin{pmatrix}1 & 2 \\\\ 3 & 5\\end{pmatrix}$', 0, ''),
    ('complex_math_expressions', '$\\frac{1}{12}$', '$0.0833333333333333$', 1, ''),
    ('complex_math_expressions', '$(1,\\frac{9}{2})$', '$(1,4.5)$', 1, ''),
    ('complex_math_expressions', '$\\frac{x+2}{7}$', '$\\frac{x}{7}+\\frac{2}{7}$', 1, ''),
    ('complex_math_expressions', '$\\tan^2(y)+1$', '$\\sec^2(y)$', 1, ''),
    ('complex_math_expressions', '$\\begin{pmatrix}-\\\x0crac{7}{4}&-2\\\\4&\\frac{1}{4}\\\\\\end{pmatrix}$', '$\\begin{pmatrix}-\\\x0crac{7}{4}&-2\\\\4&\\frac{1}{4}\\\\\\end{pmatrix}$', 1, ''),
    ('complex_math_expressions', '$\\begin{pmatrix}\\frac{1}{3\\sqrt[3]{x}^2}&0&0\\\\0&1&0\\\\-\\sin(x)&0&0\\\\\\end{pmatrix}$', '$\\begin{pmatrix}\\frac{1}{3x^{2/3}}&0&0\\\\0&1&0\\\\-\\sin(x)&0&0\\end{pmatrix}$', 1, ''),
    ('complex_math_expressions', '$34x+45y-20z+100=0$', '$-34x-45y+20z-100=0$', 1, ''),
    ('complex_math_expressions', '$(\\begin{pmatrix}\\frac{1}{3}\\\\ \\frac{1}{5} \\end{pmatrix})$', '$\\begin{pmatrix}0.33\\\\0.2 \\end{pmatrix}$', 1, 'float_rounding=2'),
    ('complex_math_expressions', '$\\frac{\\sqrt{\\sqrt{11}+\\sqrt{194}}}{15+2\\sqrt{33}}$', '$\\frac{\\sqrt{\\sqrt{11}+\\sqrt{194}}}{2\\sqrt{33}+15}$', 1, ''),
    ('complex_math_expressions', '$(a+5)(b+2)$', '$(+5)(b+2)$', 0, ''),
    ('complex_math_expressions', '$2$', '$\\frac{1+\\sqrt{5}}{2}$', 0, ''),
    ('complex_math_expressions', '$4$', '$\\frac{34}{16}+\\frac{\\sqrt{1358}}{16}$', 0, ''),
    ('complex_math_expressions', '$1\\sqrt{19}$', '$1$', 0, ''),
    ('complex_math_expressions', '$(\\frac{3}{5},\\frac{8}{3}]$', '$(0.6,2.6667]$', 1, 'float_rounding=2'),
    ('complex_math_expressions', '$x+2n+1$', '$x+1$', 0, ''),
    ('math_extraction_additional_cases', '$34$', 'Final Answer: The largest $n$ is 34.', 1, ''),
    ('math_extraction_additional_cases', '$(3,1)$', '${1,3}$', 0, ''),
    ('math_extraction_additional_cases', '$(1,3)$', '${1,3}$', 1, ''),
    ('math_extraction_additional_cases', '$[-4,0]$', 'Thus, the values of \\( k \\) for which the quadratic has real roots are: \\[ \\boxed{[-4, 0]} \\]', 1, ''),
    ('math_extraction_additional_cases', '\\(\\boxed{\\text{C}}\\).', '$\\boxed{\\text{(C)}}.$', 1, ''),
    ('math_extraction_additional_cases', ' So the answer is: \\[ \\boxed{11111111100} \\]', 'is $\\boxed{11,\\! 111,\\! 111,\\! 100}$', 1, ''),
    ('math_extraction_additional_cases', ' So the answer is: \\[ \\boxed{32349} \\]', 'is $\\boxed{32,\\! 349}$', 1, ''),
    ('math_extraction_additional_cases', ' So the answer is: \\[ \\boxed{32349} \\]', 'is $\\boxed{32, 349}$', 0, ''),
    ('math_extraction_additional_cases', 'Thus, the domain of the function \\( f(x) \\) is: \\[ \\boxed{(2, 12) \\cup (12, 102)} \\]', 'Thus, the answer is $x \\in \\boxed{(2,12) \\cup (12,102)}$', 1, ''),
    ('math_extraction_additional_cases', '$\\text{E}$', '$E$', 1, ''),
    ('math_extraction_additional_cases', '$\\boxed{1}\\boxed{2}$', '$\\boxed{1,2}$', 1, ''),
    ('set_rel_assymetry', '$-2 \\\\le x \\\\le 7$', '$x \\in [-2,7]$', 1, 'allow_set_relation_comp=True'),
    ('set_rel_assymetry', '$-2 \\\\le x \\\\le 7$', '$x \\in [-2,7]$', 1, 'allow_set_relation_comp=False'),
    ('set_rel_assymetry', '$x \\in [-2,7]$', '$-2 \\\\le x \\\\le 7$', 1, 'allow_set_relation_comp=True'),
    ('set_rel_assymetry', '$x \\in [-2,7]$', '$-2 \\\\le x \\\\le 7$', 0, 'allow_set_relation_comp=False'),
    ('sqrt_precision', '$4$', '$4\\sqrt{2}$', 0, ''),
    ('symbols', '$\text{13}$', '$13$', 0, ''),
    ('numina_cases', '$(37,3,3,13),(17,3,3,7),(3,37,3,13),(3,17,3,7),(3,3,2,3)$', '$\\boxed{(3, 37, 3, 13), (3, 17, 3, 7), (3, 3, 2, 3), (3,17,3,7), (17,3,3,7), (37,3,3,13)}$', 1, ''),
    ('numina_cases', '$(p,q)=(3,2)$', '$(3,2)$', 1, ''),
    ('numina_cases', '$(0;0;0),(0;-2;0),(0;0;6),(0;-2;6),(4;0;0),(4;-2;0),(4;0;6),(4;-2;6)$', '\\boxed{(4, 0, 6), (4, -2, 6), (0, 0, 6), (0, -2, 6), (4, 0, 0), (4, -2, 0), (0, 0, 0), (0, -2, 0)}', 1, ''),
    ('numina_cases', '$1\\leq|z|\\leq \\frac{3}{2}$', '$z \\in \\left[-\\frac{3}{2}, -1\\right] \\cup \\left[1, \\frac{3}{2}\\right]$', 1, ''),
    ('numina_cases', '$-12;-11;-10;-8;-7;-6$', '$\\boxed{\\{-12, -11, -10, -8, -7, -6\\}}$', 1, ''),
    ('numina_cases', '$AB=4,CD=5$', '$\\boxed{4, 5}$', 1, ''),
    ('numina_cases', '$(11,7)or(7,11)$', '$\\boxed{(7,11),\\ (11,7)}$', 1, ''),
    ('numina_cases', '$S_{MBCN}:S=7:32$', '$\\boxed{7:32}$', 1, ''),
    ('numina_cases', '$\\frac{NO}{BO}=\\frac{1}{\\sqrt{6}}$', '$\\frac{1}{\\sqrt{6}}$', 1, ''),
    ('numina_cases', '$p=5,q=2;p=7,q=2$', '$(5,2),(7,2)$', 1, ''),
    ('numina_cases', '$(p,q,r)=(3,2,7)$', '$(3,2,7)$', 1, ''),
    ('numina_cases', '$V_{1}:V_{2}=11:21$', '$11:21$', 1, ''),
    ('numina_cases', '$(2,1),(1,2),(-1,-20),(-20,-1)$', 'solutions are:\n\n\\[\n\\boxed{(1, 2)}, \\boxed{(2, 1)}, \\boxed{(-1, -20)}, \\boxed{(-20, -1)}\n\\]', 1, ''),
    ('numina_cases', '\\(\\boxed{1}\\) and \\(\\boxed{-2}\\).', '$\\boxed{-2,1}$.', 1, ''),
    ('numina_cases', '$\\text{odd}$', '$odd$', 1, ''),
    ('numina_cases', '$\\text{e}$', '$e$', 1, ''),
    ('numina_cases', '$\\text{E}$', '$E$', 1, ''),
    ('numina_cases', '$d$', '$\\text{E}$', 0, ''),
    ('numina_cases', '$1$ and $2$ and $3$', '$\\boxed{1,2,3}$', 1, ''),
    ('numina_cases', '$(37,3,3,13),(17,3,3,7),(3,37,3,13),(3,17,3,7),(3,3,2,3)$', '$\\boxed{(3, 37, 3, 13), (3, 17, 3, 7), (3, 3, 2, 3), (3,17,3,7), (17,3,3,7), (37,3,3,13)}$', 1, ''),
    ('numina_cases', '$(37,3,3),(17,3,3,7),(3,37,3,13),(3,17,3,7),(3,3,2,3)$', '$\\boxed{(3, 37, 3, 13), (3, 17, 3, 7), (3, 3, 2, 3), (3,17,3,7), (17,3,3,7), (37,3,3,13)}$', 0, ''),
    ('numina_cases', '$(p,q)=(3,2)$', '$\\boxed{(3, 2)}$', 1, ''),
    ('numina_cases', '\\boxed{x = -5,\\ p = \\frac{14}{3}} ', '$\\boxed{-5, \\frac{14}{3}}$', 1, ''),
    ('numina_cases', '\\boxed{a=4,\\,-8,\\,-10}', '$\\boxed{-10,-8,4}$', 1, ''),
    ('numina_cases', '\\\\boxed{W(n) = 1 \\\\text{ and } W(n) = -1', 'W(x)=1orW(x)=-1', 1, ''),
    ('numina_cases', '$21,16$ or $11$', '$21,16,11$', 1, ''),
    ('numina_cases', '\\n\\n\\[ \\boxed{p = -1 \\text{ and } p = \\dfrac{15}{8}} \\]', '$p=-1,p=\\frac{15}{8}$', 1, ''),
    ('numina_cases', '$0<f(x)<1$', '$(0,1)$', 1, ''),
    ('numina_cases', '\\(\\boxed{6 \\text{ and } 8}\\)', '$\\boxed{6,8}$', 1, ''),
    ('numina_cases', '$\\text{Even}$', '$Even$', 1, ''),
    ('open_thoughts', '$$\\boxed{2}, \\boxed{3}, \\boxed{5}, \\boxed{7}, \\boxed{13}$$', '$${2, 3, 5, 7, 13}$$', 1, ''),
    ('open_thoughts', '$$f(y) = y$$', '$$f(y) = y$$', 1, ''),
    ('open_thoughts', '$$-793 < a < 10$$', '$$(-793, 10)$$', 1, ''),
    ('open_thoughts', '$$\\text{The midpoints form a regular hexagon}$$', '$$\\text{The midpoints form a regular hexagon}$$', 1, ''),
    ('open_thoughts', '$$a_3 = 2, a_{37} = 19$$', '$$\\boxed{a_{37} = 19, \\quad a_3 = 2}$$', 1, ''),
    ('open_thoughts', '$$(2, 2), (1, 3), (3, 3)$$', '$$\\boxed{(2, 2), (1, 3), (3, 3)}$$', 1, ''),
    ('open_thoughts', '$$(1, +\\infty)$$', '$$(1, +\\infty)$$', 1, ''),
    ('open_thoughts', '$$x = \\frac{1}{2}, x = \\frac{-1 \\pm \\sqrt{13}}{4}$$', '$$\\boxed{x = \\frac{1}{2}, x = \\frac{-1 \\pm \\sqrt{13}}{4}}$$', 1, ''),
    ('open_thoughts', '$$0.06 \\text{ yuan}$$', '$$\\boxed{0.06 \\text{ yuan}}$$', 1, ''),
    ('open_thoughts', '$$(5, 8), (8, 5)$$', '$$\\boxed{(x, y) = (5, 8) \\quad \\text{and} \\quad (8, 5)}$$', 1, ''),
    ('open_thoughts', '$$667$$', '$$\\boxed{667}$$', 1, ''),
    ('open_thoughts', '$$6 \\text{ and } 8$$', '$$\\boxed{6 \\text{ and } 8}$$', 1, ''),
    ('open_thoughts', '$$(2, 2), (6, 2)$$', '$$\\boxed{(2, 2)} \\quad \\text{and} \\quad \\boxed{(6, 2)}$$', 1, ''),
    ('open_thoughts', '$$(98, 2), (99, 503)$$', '$$\\boxed{(98, 2)} \\quad \\text{and} \\quad \\boxed{(99, 503)}$$', 1, ''),
    ('open_thoughts', '$$(3, 3), (1, 1)$$', '$$\\boxed{(3, 3)} \\text{ for part (a) and } \\boxed{(1, 1)}$$', 1, ''),
    ('open_thoughts', '$$k \\ge 2$$', '$$\\boxed{k \\ge 2}$$', 1, ''),
    ('open_thoughts', '$$k = 45, n = 2$$', '$$\\boxed{k = 45} \\quad \\text{and} \\quad \\boxed{n = 2}$$', 1, ''),
    ('open_thoughts', '$${1,2,3}$$', '\\boxed{1} and \\boxed{2} and \\boxed{3}', 1, ''),
    ('open_thoughts', '$${1,2,3}$$', '\\boxed{1},\\boxed{2},\\boxed{3}', 1, ''),
    ('open_thoughts', '$$|AB|=1$$', '$$1$$', 1, ''),
    ('open_thoughts', '$$A:B=1$$', '$$1$$', 1, ''),
    ('open_thoughts', '$$f(x)=1$$', '$$1$$', 1, ''),
    ('open_thoughts', '$x_{1}=10^{\\frac{-5+\\sqrt{13}}{6}},\\quadx_{2}=10^{\\frac{-5-\\sqrt{13}}{6}}$', '$\\boxed{10^{\\frac{\\sqrt{13} - 5}{6}}} \\quad \\text{and} \\quad \\boxed{10^{-\\frac{5 + \\sqrt{13}}{6}}}$', 1, ''),
    ('open_thoughts', '$y_{1}=-2 x^{2}+4 x+3, y_{2}=3 x^{2}+12 x+10$', '\\($y_1 = \\boxed{-2(x - 1)^2 + 5} \\) and \\( y_2 = \\boxed{3(x + 2)^2 - 2} \\) ', 1, ''),
    ('open_thoughts', '$x_{1}=\\frac{1}{2}+\\frac{31\\sqrt{5}}{216},\\quadx_{2}=\\frac{1}{2}-\\frac{31\\sqrt{5}}{216}$', '$\\boxed{\\dfrac{108 + 31\\sqrt{5}}{216}} \\quad \\text{and} \\quad \\boxed{\\dfrac{108 - 31\\sqrt{5}}{216}}$', 1, ''),
    ('open_thoughts', '$x_{1}=10^{\\frac{-5+\\sqrt{13}}{6}},\\quadx_{2}=10^{\\frac{-5-\\sqrt{13}}{6}}$', '$\\boxed{10^{\\frac{\\sqrt{13} - 5}{6}}} \\quad \\text{and} \\quad \\boxed{10^{-\\frac{5 + \\sqrt{13}}{6}}}$', 1, ''),
    ('open_thoughts', '\\boxed{1} papers and \\boxed{2} bins', '$\\boxed{1,2}$', 1, ''),
    ('open_thoughts', '\\boxed{1} no no no no no \\boxed{2}', '$\\boxed{1,2}$', 0, ''),
    ('string_extraction', '$n=1, 2, 3$', '$n=1, 2, 3$', 1, ''),
    ('string_extraction', '$n=2, 3, 4$', '$n=1, 2, 3$', 0, ''),
    ('string_extraction', '$D = (0, 1)$', '$D = (0, 1)$', 1, ''),
    ('string_extraction', '$D = (0, 1)$', '$D = (0, 1.5)$', 0, ''),
    ('string_extraction', '$F_n = \\sum_{k=0}^{n-1} F_k F_{n-k-1}$', '$F_n = \\sum_{k=0}^{n-2} F_k F_{n-k-2}$', 0, ''),
    ('string_extraction', '$F_n = \\sum_{k=0}^{n-1} F_k F_{n-k-1}$', '$F_n = \\sum_{k=0}^{n-1} F_{n-k-1} F_k$', 1, ''),
    ('string_extraction', '$19, 46, and 82$', '$19, 46, \\text{ and } 82$', 1, ''),
    ('string_extraction', '$19, 46, and 82$', '$21, 36, and 82$', 0, ''),
    ('string_extraction', '$1 - \\frac{1}{\\mathrm{e}}$', '$1 - \\frac{1}{\\mathrm{e}}$', 1, ''),
    ('string_extraction', '$1 - \\frac{1}{\\mathrm{e}}$', '$1 + \\frac{1}{\\mathrm{e}}$', 1, ''),
    ('string_extraction', '$\\pm 2021$', '$2021$', 0, ''),
    ('string_extraction', '$\\pm 2021$', '${-2021, 2021}$', 1, ''),
    ('string_extraction', '$12:00$', '$1:00$', 0, ''),
    ('string_extraction', '$12:00$', '$12:00$', 1, ''),
    ('boxed', '$\\\\boxed{35 cm} ++++++ \\\\boxed{4}$', '${35 cm,4}$', 1, ''),
    ('strict_variable_comparison', '$f(x)$', '$f(y)$', 0, 'strict=True'),
    ('strict_variable_comparison', '$f(x)$', '$f(y)$', 1, 'strict=False'),
]

# why we disagree with Math-Verify's expected value, per (gold, prediction)
EXTRACTION = "extraction: no box in the prediction (ours reads the last \\boxed{} only, theirs any answer-like span)"
DECIMAL_COMMA = "strict by design: a comma is a list or thousands separator, never a decimal comma"
ROUNDING = "strict by design: decimals by their written precision, never rounded to a tolerance"
LAST_BOX = "by design: a completion's answer is its last box, with the boxes only separators divide from it"
ORDERED = "by design: a tuple is not a set or list; a list keeps its multiplicity"
CHAIN = "by design: a chain of equalities is read only as name = ... = value (its last value)"
THEIR_GOLD = "their gold is malformed (a literal '\\\\' before 'le' / an unclosed box): ours reads nothing"
THEIR_EXPECTED = "their expected value is not the mathematics (1 - 1/e is not 1 + 1/e)"
NO_RENAMING = "by design: variables are not renamed (their strict=False equates f(x) and f(y))"
SEMICOLON = "open: ';' as a separator (0;-2;6) is not read"
NAMED_QUANTITY = "open: a named quantity other than a variable, function or segment (|AB|, A:B, NO/BO) is not a name"
RATIO = "open: a ratio a:b is not read"
FUNCTION_RELATION = "open: an inequality on f(x) rather than on a variable is not read"
NAMES_PAIR = "by design: two or more names pair their values; a bare list does not say which value is which"
SEPARATED_BOXES = "by design: a gold's boxes are all its answer, whatever text separates them"
DISAGREEMENTS: dict[tuple[str, str], str] = {
    ("1000.99", "1000,99"): DECIMAL_COMMA,
    ("1,22", "1.22"): DECIMAL_COMMA,
    ("0,111", "0.111"): DECIMAL_COMMA,
    ("$(\\begin{pmatrix}\\frac{1}{3}\\\\ \\frac{1}{5} \\end{pmatrix})$", "$\\begin{pmatrix}0.33\\\\0.2 \\end{pmatrix}$"): ROUNDING,
    ("$(\\frac{3}{5},\\frac{8}{3}]$", "$(0.6,2.6667]$"): ROUNDING,
    ("$1 = \\zzz = x = 0$", "$0$"): CHAIN,
    ("$(1,3)$", "${1,3}$"): ORDERED,
    ("$(37,3,3,13),(17,3,3,7),(3,37,3,13),(3,17,3,7),(3,3,2,3)$",
     "$\\boxed{(3, 37, 3, 13), (3, 17, 3, 7), (3, 3, 2, 3), (3,17,3,7), (17,3,3,7), (37,3,3,13)}$"): ORDERED,
    ("$-2 \\\\le x \\\\le 7$", "$x \\in [-2,7]$"): THEIR_GOLD,
    ("$x \\in [-2,7]$", "$-2 \\\\le x \\\\le 7$"): THEIR_GOLD,
    ("\\\\boxed{W(n) = 1 \\\\text{ and } W(n) = -1", "W(x)=1orW(x)=-1"): THEIR_GOLD,
    ("$1 - \\frac{1}{\\mathrm{e}}$", "$1 + \\frac{1}{\\mathrm{e}}$"): THEIR_EXPECTED,
    ("$f(x)$", "$f(y)$"): NO_RENAMING,
    ("$(0;0;0),(0;-2;0),(0;0;6),(0;-2;6),(4;0;0),(4;-2;0),(4;0;6),(4;-2;6)$",
     "\\boxed{(4, 0, 6), (4, -2, 6), (0, 0, 6), (0, -2, 6), (4, 0, 0), (4, -2, 0), (0, 0, 0), (0, -2, 0)}"): SEMICOLON,
    ("$-12;-11;-10;-8;-7;-6$", "$\\boxed{\\{-12, -11, -10, -8, -7, -6\\}}$"): SEMICOLON,
    ("$p=5,q=2;p=7,q=2$", "$(5,2),(7,2)$"): SEMICOLON,
    ("$S_{MBCN}:S=7:32$", "$\\boxed{7:32}$"): RATIO,
    ("$V_{1}:V_{2}=11:21$", "$11:21$"): RATIO,
    ("$\\frac{NO}{BO}=\\frac{1}{\\sqrt{6}}$", "$\\frac{1}{\\sqrt{6}}$"): NAMED_QUANTITY,
    ("$$|AB|=1$$", "$$1$$"): NAMED_QUANTITY,
    ("$$A:B=1$$", "$$1$$"): NAMED_QUANTITY,
    ("$0<f(x)<1$", "$(0,1)$"): FUNCTION_RELATION,
    ("\\boxed{1} no no no no no \\boxed{2}", "$\\boxed{1,2}$"): SEPARATED_BOXES,
    ("$AB=4,CD=5$", "$\\boxed{4, 5}$"): NAMES_PAIR,
    ("$x_{1}=10^{\\frac{-5+\\sqrt{13}}{6}},\\quadx_{2}=10^{\\frac{-5-\\sqrt{13}}{6}}$",
     "$\\boxed{10^{\\frac{\\sqrt{13} - 5}{6}}} \\quad \\text{and} \\quad \\boxed{10^{-\\frac{5 + \\sqrt{13}}{6}}}$"): NAMES_PAIR,
    ("$x_{1}=\\frac{1}{2}+\\frac{31\\sqrt{5}}{216},\\quadx_{2}=\\frac{1}{2}-\\frac{31\\sqrt{5}}{216}$",
     "$\\boxed{\\dfrac{108 + 31\\sqrt{5}}{216}} \\quad \\text{and} \\quad \\boxed{\\dfrac{108 - 31\\sqrt{5}}{216}}$"): NAMES_PAIR,
    ("\\boxed{x = -5,\\ p = \\frac{14}{3}} ", "$\\boxed{-5, \\frac{14}{3}}$"): NAMES_PAIR,
}


def _classify(gold: str, pred: str) -> str | None:
    """The class of a disagreement: listed above, or by rule (prose without a box; a completion with several boxes)."""
    if (gold, pred) in DISAGREEMENTS:
        return DISAGREEMENTS[(gold, pred)]
    if "\\boxed" not in pred and re.search(r"(?<![\\A-Za-z])[A-Za-z]{3,}", re.sub(r"\$[^$]*\$", "", pred)):
        return EXTRACTION
    if pred.count("\\boxed") > 1:
        return LAST_BOX
    return None


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, "..", "tests", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _block(code: str) -> str:
    return f"```python\n{code}\n```"


def math_verify_table(math_reward) -> int:
    """Ours vs Math-Verify's expected value on their cases; returns the number of unclassified disagreements."""
    t0 = time.perf_counter()
    completions = [p if "\\boxed" in p else f"\\boxed{{{p}}}" for _, _, p, _, _ in MATH_VERIFY_CASES]
    ours = math_reward(completions, [g for _, g, _, _, _ in MATH_VERIFY_CASES])
    agree, classes, unclassified = 0, Counter(), []
    for (group, gold, pred, expected, setting), score in zip(MATH_VERIFY_CASES, ours):
        if int(score) == expected:
            agree += 1
            continue
        why = _classify(gold, pred)
        if why is None:
            unclassified.append((group, gold, pred, expected, int(score), setting))
        classes[why or "unclassified"] += 1
    print(f"math-verify cases: {len(MATH_VERIFY_CASES)}, ours agrees on {agree} "
          f"({time.perf_counter() - t0:.1f}s); disagreements by class:")
    for why, n in classes.most_common():
        print(f"  {n:4d}  {why}")
    for u in unclassified:
        print("   unclassified:", u)
    return len(unclassified)


def main() -> None:
    from dllm_trl.rewards import code_reward, math_reward
    from dllm_trl.rewards.code import SandboxConfig

    print(f"dllm_trl from {os.path.dirname(sys.modules['dllm_trl'].__file__)}")
    if "--only" in sys.argv and sys.argv[sys.argv.index("--only") + 1] == "math-verify":
        raise SystemExit(1 if math_verify_table(math_reward) else 0)
    rows = _load("math_answer_table").MATH_TABLE
    t0 = time.perf_counter()
    got = math_reward([f"$\\boxed{{{p}}}$" for p, _, _, _ in rows], [g for _, g, _, _ in rows])
    wrong = [(p, g, e) for (p, g, e, _), r in zip(rows, got) if (r == 1.0) != e]
    print(f"math: {len(rows) - len(wrong)}/{len(rows)} right ({time.perf_counter() - t0:.1f}s)")
    for w in wrong:
        print("   wrong:", w)
    math_verify_table(math_reward)

    table = _load("code_program_table")
    cfg = SandboxConfig(timeout=2.0)
    for label, progs, want in (("legitimate", table.LEGIT, 1.0), ("hostile", table.HOSTILE, 0.0)):
        t0 = time.perf_counter()
        got = code_reward([_block(p) for _, p, _ in progs], tests=[t for _, _, t in progs], sandbox_config=cfg)
        wrong = [(name, r) for (name, _, _), r in zip(progs, got) if r != want]
        print(f"code {label}: {len(progs) - len(wrong)}/{len(progs)} right ({time.perf_counter() - t0:.1f}s)")
        issue31 = {name for name, _, _ in getattr(table, "FAIR_31", []) + getattr(table, "HOSTILE_31", [])}
        if issue31:
            rows31 = [name for name, _, _ in progs if name in issue31]
            wrong31 = [w for w in wrong if w[0] in issue31]
            print(f"   of which issue 31's rows: {len(rows31) - len(wrong31)}/{len(rows31)} right")
        for w in wrong:
            print("   wrong:", w)


if __name__ == "__main__":
    main()
