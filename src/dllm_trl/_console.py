"""A quiet console: each of the package's warnings once per run, and known third-party import noise dropped.

The noise filtered here is what every import of the package (through PEFT, TRL and transformers) prints on a CPU
machine although nothing is wrong: bitsandbytes' note that its optional CPU kernel package is missing, and DeepSpeed's
note that it found no accelerator. Only those exact messages are dropped; everything else those loggers say shows.
"""

from __future__ import annotations

import logging
import warnings

KNOWN_NOISE = {
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward",),
    "DeepSpeed": ("Setting accelerator to CPU",),
}
"""Logger name -> message prefixes that are known import noise."""


def warn_once(owner, key, message: str, category: type[Warning] = UserWarning, stacklevel: int = 2) -> None:
    """``warnings.warn`` the first time ``owner`` (what lives as long as the run: a trainer, a sampler config) meets
    ``key``, whatever the warning filters say."""
    seen = owner.__dict__.setdefault("_warned_once", set())
    if key in seen:
        return
    seen.add(key)
    warnings.warn(message, category, stacklevel=stacklevel + 1)


class _DropKnownNoise(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).lstrip().startswith(self.prefixes)


def quiet_known_noise() -> None:
    """Install the filters of :data:`KNOWN_NOISE` (once)."""
    for name, prefixes in KNOWN_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownNoise) for f in logger.filters):
            logger.addFilter(_DropKnownNoise(prefixes))
