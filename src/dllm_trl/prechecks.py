"""Checks every entry point (the main job, the examples, the evaluation) runs on its parsed training arguments before
it loads a model, so that a run that cannot finish says why in one line instead of failing minutes in."""

from __future__ import annotations

import os
import socket
import tempfile
from urllib.parse import urlparse

REPORT_PACKAGES = {"azure_ml": "azureml-core", "comet_ml": "comet-ml", "dagshub": "dagshub mlflow"}
"""``pip install`` names of the ``--report_to`` backends not installed under their own name."""


def check_report_backends(training_args) -> None:
    """A ``--report_to`` backend that is not installed (transformers would fail at trainer creation)."""
    from transformers.integrations import get_available_reporting_integrations

    available = set(get_available_reporting_integrations())
    missing = [name for name in training_args.report_to if name not in available]
    if missing:
        packages = " ".join(REPORT_PACKAGES.get(name, name) for name in missing)
        raise SystemExit(
            f"error: --report_to {' '.join(missing)}: not installed; run `pip install {packages}` "
            "or pass --report_to none."
        )


def check_hub_reachable(training_args, timeout: float = 5.0) -> None:
    """``--push_to_hub`` needs the Hub at trainer creation (transformers creates the repository there)."""
    if not getattr(training_args, "push_to_hub", False):
        return
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise SystemExit("error: --push_to_hub needs the Hub, but HF_HUB_OFFLINE is set; unset it or drop "
                         "--push_to_hub (the model is saved to --output_dir either way).")
    endpoint = urlparse(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout).close()
    except OSError as error:
        raise SystemExit(f"error: --push_to_hub: the Hub ({constants.ENDPOINT}) cannot be reached ({error}); "
                         "check the network, or drop --push_to_hub (the model is saved to --output_dir).") from None


def check_output_dir(training_args) -> None:
    """``--output_dir`` must be a folder this process can write to."""
    path = training_args.output_dir
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as error:
        raise SystemExit(f"error: --output_dir {path}: cannot write there ({error.strerror or error}); "
                         "choose a writable folder.") from None


def check_run_setup(training_args) -> None:
    """All the pre-checks: report backends, Hub reachability for ``--push_to_hub``, a writable output folder."""
    check_report_backends(training_args)
    check_hub_reachable(training_args)
    check_output_dir(training_args)
