echo "" > src/dllm_trl/__init__.py
export PYTHONPATH=toy_sweep_shim:src PYTHONUNBUFFERED=1
run() { name=$1; shift; python3 scripts/pretrain_toy.py --output-dir /tmp/$name --max-steps 4000 --eval-every 50 --target-accuracy 1.1 "$@" > $OUT/$name.log 2>&1 & }
run chat0-s1 --chat-fraction 0.0 --seed 1
run chat0-s2 --chat-fraction 0.0 --seed 2
run chat0-wd --chat-fraction 0.0 --weight-decay 0.1
run chat02 --chat-fraction 0.2
run mixed-wd --weight-decay 0.1
run b256-s1 --batch-size 256 --seed 1
run b256-lr2 --batch-size 256 --learning-rate 2e-3
wait
