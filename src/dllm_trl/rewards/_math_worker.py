"""Worker process for the expensive math-equivalence checks (math_verify, then sympy).

This file is executed as a standalone program (its source is passed to ``python -c`` by
:mod:`dllm_trl.rewards.math`), so it must not import anything from ``dllm_trl`` (that would pull in
torch) and must not rely on relative imports.  It can also be imported (``heavy_equal``) for the
in-process fallback.

Protocol (one JSON object per line):
  parent -> worker (stdin):   {"id": int, "pred": str, "gold": str, "timeout": float}
  worker -> parent (a private duplicate of the original stdout; fd 1 itself is pointed at stderr so
  that library prints cannot corrupt the stream):
      first line: {"ready": true, "backends": {...}}
      then:       {"id": int, "equal": bool, "stage": str}

Time bounds: inside the worker each comparison runs under ``signal.setitimer`` (we are the main
thread of our own process, so the alarm is usable); that soft bound cannot interrupt long C-level
work (e.g. big-integer powers), so the parent additionally kills the whole worker process group
when no answer arrives in time and starts a fresh worker.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import threading
import warnings

REL_TOL = 1e-6


class _SoftTimeout(BaseException):
    """Raised by the SIGALRM handler; BaseException so that library ``except Exception`` blocks
    inside sympy / math_verify do not swallow it."""


# ----------------------------------------------------------------------------- backend discovery
def _discover_backends():
    info = {"math_verify": None, "sympy_parser": None, "errors": []}
    mv = None
    try:
        import math_verify  # noqa: F401
        from math_verify import parse as mv_parse
        from math_verify import verify as mv_verify

        mv = (mv_parse, mv_verify)
        info["math_verify"] = getattr(math_verify, "__version__", "unknown")
    except Exception as exc:  # pragma: no cover - depends on the environment
        info["errors"].append(f"math_verify unavailable: {type(exc).__name__}: {exc}")

    parser = None
    try:
        from latex2sympy2_extended import latex2sympy

        import sympy

        if sympy.simplify(latex2sympy(r"\frac{1}{2}") - sympy.Rational(1, 2)) == 0:
            parser = lambda s: latex2sympy(s)  # noqa: E731
            info["sympy_parser"] = "latex2sympy2_extended"
    except Exception as exc:  # pragma: no cover
        info["errors"].append(f"latex2sympy2_extended unusable: {type(exc).__name__}: {exc}")
    if parser is None:
        try:
            import sympy
            from sympy.parsing.latex import parse_latex

            if sympy.simplify(parse_latex(r"\frac{1}{2}") - sympy.Rational(1, 2)) == 0:
                parser = parse_latex
                info["sympy_parser"] = "sympy.parsing.latex"
        except Exception as exc:  # pragma: no cover
            info["errors"].append(f"sympy.parsing.latex unusable: {type(exc).__name__}: {exc}")
    return mv, parser, info


_BACKENDS = None


def _backends():
    global _BACKENDS
    if _BACKENDS is None:
        logging.getLogger("math_verify").setLevel(logging.CRITICAL)
        logging.getLogger("latex2sympy2_extended").setLevel(logging.CRITICAL)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _BACKENDS = _discover_backends()
    return _BACKENDS


# ----------------------------------------------------------------------------- sympy comparison
def _sym_equal(a, b, depth=0):
    import sympy

    if depth > 6:
        return False
    try:
        if a == b:
            return True
    except Exception:
        pass
    # relations: x = 5  vs  5  -> compare right-hand sides when the left side is a lone symbol
    if isinstance(a, sympy.Eq) and isinstance(a.lhs, sympy.Symbol):
        return _sym_equal(a.rhs, b, depth + 1)
    if isinstance(b, sympy.Eq) and isinstance(b.lhs, sympy.Symbol):
        return _sym_equal(a, b.rhs, depth + 1)
    seq_types = (tuple, list, sympy.Tuple)
    if isinstance(a, seq_types) or isinstance(b, seq_types):
        if not (isinstance(a, seq_types) and isinstance(b, seq_types)) or len(a) != len(b):
            return False
        return all(_sym_equal(x, y, depth + 1) for x, y in zip(a, b))
    if isinstance(a, sympy.FiniteSet) or isinstance(b, sympy.FiniteSet):
        if not (isinstance(a, sympy.FiniteSet) and isinstance(b, sympy.FiniteSet)):
            return False
        xs, ys = list(a.args), list(b.args)
        if len(xs) != len(ys):
            return False
        for x in xs:
            for j, y in enumerate(ys):
                if _sym_equal(x, y, depth + 1):
                    del ys[j]
                    break
            else:
                return False
        return True
    if isinstance(a, sympy.Interval) or isinstance(b, sympy.Interval):
        if not (isinstance(a, sympy.Interval) and isinstance(b, sympy.Interval)):
            return False
        return (
            a.left_open == b.left_open
            and a.right_open == b.right_open
            and _sym_equal(a.start, b.start, depth + 1)
            and _sym_equal(a.end, b.end, depth + 1)
        )
    if isinstance(a, sympy.Set) or isinstance(b, sympy.Set):
        try:
            return bool(a == b) or bool(sympy.simplify(a.symmetric_difference(b)) == sympy.EmptySet)
        except Exception:
            return False
    if not (isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr)):
        return False
    try:
        if sympy.simplify(a - b) == 0:
            return True
    except Exception:
        pass
    if not a.free_symbols and not b.free_symbols:
        try:
            va, vb = complex(sympy.N(a, 30)), complex(sympy.N(b, 30))
            if any(math.isnan(v.real) or math.isnan(v.imag) for v in (va, vb)):
                return False
            return abs(va - vb) <= REL_TOL * max(1.0, abs(vb))
        except Exception:
            return False
    return False


def _math_verify_equal(mv, pred, gold):
    mv_parse, mv_verify = mv
    gold_p = mv_parse("$" + gold + "$", parsing_timeout=None)
    pred_p = mv_parse("$" + pred + "$", parsing_timeout=None)
    if not gold_p or not pred_p:
        return False
    return bool(mv_verify(gold_p, pred_p, timeout_seconds=None))


def heavy_equal(pred: str, gold: str, timeout: float = 5.0) -> tuple[bool, str]:
    """math_verify, then sympy. Returns (equal, stage). Never raises (except _SoftTimeout is turned
    into ``(False, "timeout")``). Uses SIGALRM only when called from the main thread."""
    mv, parser, _ = _backends()
    use_alarm = threading.current_thread() is threading.main_thread() and timeout and timeout > 0

    def _handler(signum, frame):
        raise _SoftTimeout()

    old = None
    if use_alarm:
        old = signal.signal(signal.SIGALRM, _handler)
        signal.setitimer(signal.ITIMER_REAL, float(timeout))
    stage = "none"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if mv is not None:
                stage = "math_verify"
                try:
                    if _math_verify_equal(mv, pred, gold):
                        return True, stage
                except _SoftTimeout:
                    raise
                except Exception:
                    pass
            if parser is not None:
                stage = "sympy"
                try:
                    a, b = parser(pred), parser(gold)
                    if _sym_equal(a, b):
                        return True, stage
                except _SoftTimeout:
                    raise
                except Exception:
                    pass
        return False, stage
    except _SoftTimeout:
        return False, "timeout"
    except BaseException:  # RecursionError, MemoryError, ...
        return False, "error"
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


# ----------------------------------------------------------------------------- worker main loop
def _main():
    try:
        import resource

        cap = int(os.environ.get("DLLM_TRL_MATH_WORKER_MEM_BYTES", str(4 << 30)))
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    except Exception:
        pass
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints from libraries go to stderr, never into the protocol stream
    sys.stdout = sys.stderr
    _, _, info = _backends()
    out.write(json.dumps({"ready": True, "backends": info}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            equal, stage = heavy_equal(str(req["pred"]), str(req["gold"]), float(req.get("timeout", 5.0)))
            resp = {"id": req.get("id"), "equal": bool(equal), "stage": stage}
        except Exception as exc:
            resp = {"id": None, "equal": False, "stage": f"error: {type(exc).__name__}"}
        out.write(json.dumps(resp) + "\n")
        out.flush()


if __name__ == "__main__":
    _main()
