"""Environment variables modelzoo touches, in one place (no other module reads or sets any).

modelzoo reads no variable of its own: every setting is a command-line option or an argument.
It only sets the Hugging Face offline switches for its tests and benchmark, so that nothing
they run can reach the hub (the library code already loads with ``local_files_only=True``).
"""

from __future__ import annotations

import os

HF_HUB_OFFLINE = "HF_HUB_OFFLINE"
"""Set to 1 by :func:`force_offline`: huggingface_hub raises instead of downloading."""

TRANSFORMERS_OFFLINE = "TRANSFORMERS_OFFLINE"
"""Set to 1 by :func:`force_offline`: transformers' own offline switch."""


def force_offline() -> None:
    """Make every later hub access in this process fail instead of downloading.

    Call it before transformers or diffusers is imported: they read the switches at import.
    """
    os.environ[HF_HUB_OFFLINE] = "1"
    os.environ[TRANSFORMERS_OFFLINE] = "1"
