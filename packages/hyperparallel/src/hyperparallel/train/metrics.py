"""Training metrics: a JSON record written atomically, and the loss curve as a PNG."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from npu_core.files import atomic_path, write_text_atomic


@dataclass
class MetricsLog:
    """Per-step training records and per-evaluation validation losses (rank 0 keeps it)."""

    train: list[dict[str, float]] = field(default_factory=list)
    val: list[dict[str, float]] = field(default_factory=list)

    @classmethod
    def resume(cls, path: Path, step: int) -> MetricsLog:
        """Records of a previous run up to ``step`` (later ones belong to a lost future)."""
        if not path.is_file():
            return cls()
        data = json.loads(path.read_text())
        return cls(
            train=[r for r in data.get("train", []) if r["step"] <= step],
            val=[r for r in data.get("val", []) if r["step"] <= step],
        )

    def write(self, path: Path, config: dict) -> None:
        """Replace ``path`` atomically with the records and the run's configuration."""
        write_text_atomic(path, json.dumps({"config": config, **asdict(self)}, indent=1))

    def plot(self, path: Path) -> None:
        """Training and validation loss against step, saved as a PNG."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
        ax.plot([r["step"] for r in self.train], [r["loss"] for r in self.train], label="train")
        if self.val:
            ax.plot([r["step"] for r in self.val], [r["loss"] for r in self.val], "o-", label="val")
        ax.set(xlabel="step", ylabel="cross-entropy (nats / byte)", title="hyperparallel train")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        try:
            with atomic_path(path) as tmp:
                fig.savefig(tmp)
        finally:
            plt.close(fig)
