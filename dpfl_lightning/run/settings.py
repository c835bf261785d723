"""The settings of :class:`~dpfl_lightning.FederatedTrainer`: one frozen, typed object, built once
from the trainer's arguments with one clear error per bad setting. Every part of a run reads the
settings it needs from here; none of them sees the trainer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from dpfl_lightning.errors import ConfigError, require

WEIGHTINGS = ("uniform", "samples")
NONFINITE_POLICIES = ("raise", "skip")
ACCELERATORS = ("auto", "cpu", "cuda", "gpu")
CLIP_ALGORITHMS = ("norm", "value")
# precision names lightning.Trainer accepts -> the one they mean here
PRECISION_ALIASES = {"32": "32-true", "32-true": "32-true", "bf16-mixed": "bf16-mixed", "bf16": "bf16-mixed",
                     "16-mixed": "16-mixed", "16": "16-mixed"}


def normalize_precision(value: object) -> str:
    """``precision`` as Lightning names it (``32-true``, ``bf16-mixed``, ``16-mixed``); other values are
    refused with the reason."""
    key = str(value).strip()
    if key in PRECISION_ALIASES:
        return PRECISION_ALIASES[key]
    if key in ("64", "64-true", "16-true", "bf16-true") or key.startswith("transformer-engine"):
        raise ConfigError("trainer.precision", value, "the parameters and the global model stay one fp32 buffer "
                          "(updates are summed exactly in fp32), so only mixed precision (autocast) is possible",
                          "use '32', 'bf16-mixed' or '16-mixed' (CUDA)")
    raise ConfigError("trainer.precision", value, "unknown precision", "use '32', 'bf16-mixed' or '16-mixed' (CUDA)")


def check_trainer_settings(s: dict[str, Any]) -> dict[str, Any]:  # noqa: C901 - one require per setting
    """Validate the trainer's arguments; return them with the defaults that depend on others filled
    in (``local_epochs`` when neither it nor ``local_steps`` is set, ``sampling``)."""
    require(isinstance(s["rounds"], int) and s["rounds"] >= 1, "trainer.rounds", s["rounds"], "must be an integer >= 1",
            "set rounds >= 1")
    require(s["local_epochs"] is None or s["local_steps"] is None, "trainer.local_steps", s["local_steps"],
            "local_epochs and local_steps are both set", "set only one of them")
    if s["local_epochs"] is None and s["local_steps"] is None:
        s["local_epochs"] = 1
    for name in ("local_epochs", "local_steps"):
        if s[name] is not None:
            require(s[name] >= 1, f"trainer.{name}", s[name], "must be >= 1", f"set {name} >= 1")
    records = s.get("records_per_client")
    require(records is None or (isinstance(records, int) and not isinstance(records, bool) and records >= 1),
            "trainer.records_per_client", records, "must be an integer >= 1 or None",
            "set the public number of records per client (None: each client's own count, not public)")
    require(s["batch_size"] is None or s["batch_size"] >= 1, "trainer.batch_size", s["batch_size"], "must be >= 1 or None",
            "set a positive batch size (None: full batch)")
    require(s["clients_per_round"] is None or s["clients_per_round"] >= 1, "trainer.clients_per_round",
            s["clients_per_round"], "must be >= 1", "set clients_per_round >= 1 (or leave it unset for full participation)")
    require(0 < s["client_lr_decay"] <= 1, "trainer.client_lr_decay", s["client_lr_decay"], "must be in (0, 1]",
            "set e.g. 0.99")
    require(s["weighting"] in WEIGHTINGS, "trainer.weighting", s["weighting"], "unknown weighting",
            "use 'uniform' or 'samples'")
    require(s["eval_every"] >= 1, "trainer.eval_every", s["eval_every"], "must be >= 1", "set eval_every >= 1")
    require(s["on_nonfinite"] in NONFINITE_POLICIES, "trainer.on_nonfinite", s["on_nonfinite"], "unknown policy",
            "use 'raise' or 'skip'")
    require(s["accelerator"] in ACCELERATORS, "trainer.accelerator", s["accelerator"], "unknown accelerator",
            "use auto, cpu or cuda")
    require(s["num_threads"] is None or s["num_threads"] >= 1, "trainer.num_threads", s["num_threads"], "must be >= 1",
            "set num_threads >= 1 or leave it unset")
    require(s["checkpoint_every"] is None or s["checkpoint_every"] >= 1, "trainer.checkpoint_every",
            s["checkpoint_every"], "must be >= 1", "set checkpoint_every >= 1 or leave it unset")
    clip = s.get("gradient_clip_val")
    require(clip is None or (isinstance(clip, (int, float)) and clip >= 0), "trainer.gradient_clip_val", clip,
            "must be a number >= 0 or None", "set the local gradient clipping bound, e.g. 1.0 (None: no clipping)")
    algo = s.get("gradient_clip_algorithm")
    require(algo is None or str(algo).lower() in CLIP_ALGORITHMS, "trainer.gradient_clip_algorithm", algo,
            "unknown gradient clipping algorithm", "use 'norm' or 'value'")
    if algo is not None:
        s["gradient_clip_algorithm"] = str(algo).lower()
    acc = s.get("accumulate_grad_batches", 1)
    require(isinstance(acc, int) and acc >= 1, "trainer.accumulate_grad_batches", acc, "must be an integer >= 1",
            "set accumulate_grad_batches >= 1")
    if "precision" in s:
        s["precision"] = normalize_precision(s["precision"])
    if s["sampling"] is None:
        if s["clients_per_round"] is None and s["sampling_rate"] is None:
            s["sampling"] = "full"
        elif s["sampling_rate"] is not None and s["clients_per_round"] is None:
            s["sampling"] = "poisson"
        else:
            s["sampling"] = "uniform"
    return s


EXECUTOR_NAMES = ("auto", "sequential", "vmap")
_OBJECTS = ("plugins", "loggers", "algorithm", "callbacks")  # arguments that are objects, not settings


def trainer_arguments(arguments: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """From ``FederatedTrainer.__init__``'s ``locals()``: its settings (the arguments that are not
    objects), and its ``hparams`` (the settings, with the objects by name)."""
    args = {k: v for k, v in arguments.items() if k != "self" and k not in _OBJECTS}
    plugins, algorithm, callbacks = arguments["plugins"], arguments["algorithm"], arguments["callbacks"]
    hparams = dict(args, plugins=[repr(p) for p in plugins or []],
                   algorithm=repr(algorithm) if algorithm is not None else None,
                   callbacks=[type(c).__name__ for c in callbacks or []])
    return args, hparams


@dataclass(frozen=True)
class TrainerSettings:
    """Every scalar setting of a run (see :class:`~dpfl_lightning.FederatedTrainer` for their meaning),
    checked, with the defaults that depend on others filled in."""

    rounds: int = 10
    clients_per_round: int | None = None
    sampling: str | None = None
    sampling_rate: float | None = None
    local_epochs: int | None = None
    local_steps: int | None = None
    records_per_client: int | None = None
    batch_size: int | None = 32
    client_lr_decay: float = 1.0
    normalize_update_by_lr: bool = False
    weighting: str = "uniform"
    eval_every: int = 1
    eval_per_client: bool = False
    seed: int = 0
    secure: bool = False
    accelerator: str = "auto"
    communicator: str = "auto"
    num_threads: int | None = None
    exact_aggregation: bool = True
    deterministic: bool = False
    on_nonfinite: str = "raise"
    log_dir: str = "runs"
    run_name: str | None = None
    enable_progress_bar: bool = True
    enable_summary: bool = True
    checkpoint_every: int | None = None
    checkpoint_dir: str | None = None
    executor: str = "auto"
    log_client_metrics: bool | None = None
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str | None = None
    accumulate_grad_batches: int = 1
    precision: str | int = "32"
    final_checkpoint: bool = False
    test_after_fit: bool = False

    @classmethod
    def build(cls, arguments: dict[str, Any], algorithm: Any = None) -> TrainerSettings:
        """The checked settings of ``FederatedTrainer(**arguments)``; the algorithm preset may ask for
        updates in units of gradients and names the run."""
        s = check_trainer_settings(dict(arguments))
        require(s["executor"] in EXECUTOR_NAMES, "trainer.executor", s["executor"], "unknown executor",
                f"use one of {', '.join(EXECUTOR_NAMES)}")
        s["seed"] = int(s["seed"])
        s["client_lr_decay"] = float(s["client_lr_decay"])
        s["normalize_update_by_lr"] = bool(s["normalize_update_by_lr"]
                                           or getattr(algorithm, "normalize_update_by_lr", False))
        s["run_name"] = s["run_name"] or (getattr(algorithm, "name", None) or "dpfl")
        # checkpoint_dir stays None unless set: each fit then writes <log_dir>/<run_name>/version_N/checkpoints,
        # N known once the fit starts (dpfl_lightning.run.checkpointing.open_version)
        return cls(**{f.name: s[f.name] for f in dataclasses.fields(cls)})

    @classmethod
    def names(cls) -> frozenset[str]:
        return SETTING_NAMES

    def wants_cuda(self) -> bool:
        """Whether the run trains on CUDA (``accelerator=cuda`` without CUDA is refused)."""
        if self.accelerator in ("cuda", "gpu"):
            if not torch.cuda.is_available():
                raise ConfigError("trainer.accelerator", self.accelerator, "CUDA is not available on this machine",
                                  "use accelerator=auto or cpu")
            return True
        return self.accelerator == "auto" and torch.cuda.is_available()

    def is_evaluation_round(self, round_idx: int) -> bool:
        """Whether round ``round_idx`` (0-based) ends with an evaluation (every ``eval_every``, and the last)."""
        return (round_idx + 1) % self.eval_every == 0 or round_idx + 1 == self.rounds

    def is_checkpoint_round(self, round_idx: int, stopping: bool) -> bool:
        """Whether round ``round_idx`` writes a checkpoint (an early stop keeps its last round)."""
        return bool(self.checkpoint_every) and ((round_idx + 1) % self.checkpoint_every == 0
                                                or round_idx + 1 == self.rounds or stopping)


SETTING_NAMES = frozenset(f.name for f in dataclasses.fields(TrainerSettings))
