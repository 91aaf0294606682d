"""A 2-process CPU run through `accelerate launch` completes (DDP over gloo)."""

import os
import subprocess
import sys
from pathlib import Path


def test_two_process_accelerate_launch(tmp_path):
    script = Path(__file__).with_name("distributed_rldf.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               str(script), str(tmp_path / "out")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "DISTRIBUTED_OK world=2" in result.stdout
