export PYTHONPATH=toy_sweep_shim:src PYTHONUNBUFFERED=1
run() { name=$1; shift; python3 scripts/pretrain_toy.py --output-dir /tmp/$name --max-steps 4000 --eval-every 50 --target-accuracy 1.1 "$@" > $OUT/$name.log 2>&1 & }
run base
run lr5e-4 --learning-rate 5e-4
run lr2e-3 --learning-rate 2e-3
run b64 --batch-size 64
run b256 --batch-size 256
run seed1 --seed 1
run chat0 --chat-fraction 0.0
wait
