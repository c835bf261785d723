"""From a parsed ``dpfl`` configuration to a run's objects: the model's seed, the data as a
:class:`~dpfl_lightning.FederatedDataModule` (a plain LightningDataModule split over clients), the
check that the model's outputs fit the data's labels, and the configuration text a run saves."""

from __future__ import annotations

import inspect
from typing import Any

from jsonargparse import ArgumentParser

from dpfl_lightning.errors import require


def expect_model_labels(model: Any, data: Any) -> None:
    """A classifier's ``num_classes`` bounds the labels: have the data check them when it is set up
    (one line naming the data and the setting) instead of failing mid-training."""
    hp = getattr(model, "hparams", None)
    n = hp.get("num_classes") if hasattr(hp, "get") else getattr(model, "num_classes", None)
    if isinstance(n, int) and not isinstance(n, bool) and n >= 1 and hasattr(data, "expect_labels"):
        data.expect_labels(n, "model.init_args.num_classes")


def _split_defaults() -> dict[str, Any]:
    from dpfl_lightning.data.module import FederatedDataModule

    params = inspect.signature(FederatedDataModule.__init__).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def federated_data(data: Any, split: Any) -> Any:
    """``data`` as a :class:`FederatedDataModule`: a plain LightningDataModule is split over clients
    as ``split`` says (``FederatedDataModule.from_datamodule``); a FederatedDataModule is kept, and
    ``split`` options set for it are refused (it takes them in its own init_args)."""
    from dpfl_lightning.data.module import FederatedDataModule

    split = split.as_dict() if hasattr(split, "as_dict") else dict(split or {})
    if isinstance(data, FederatedDataModule):
        defaults = _split_defaults()
        changed = sorted(k for k, v in split.items() if k in defaults and v != defaults[k])
        require(not changed, f"split.{changed[0] if changed else ''}", split.get(changed[0]) if changed else None,
                f"split: applies to a plain LightningDataModule under data:, and {type(data).__name__} is split "
                "by its own init_args", f"set data.init_args.{changed[0] if changed else ''} instead")
        return data
    return FederatedDataModule.from_datamodule(data, **split)


def seed_model(section: Any) -> int | bool:
    """Seed the model's initialisation as ``seed_everything`` says (default ``trainer.seed``);
    returns the seed used (``False``: none)."""
    import lightning

    seed = section.seed_everything
    if seed is None:
        seed = section.trainer.seed
    if seed is False:
        return False
    return lightning.seed_everything(None if seed is True else int(seed), verbose=False)


def run_config_text(fit: ArgumentParser, section: Any, seed: int | bool) -> str:
    """The run's configuration as YAML that ``dpfl fit --config`` accepts: what was parsed, with
    ``seed_everything`` resolved, without the config files and checkpoint it was given."""
    ns = section.clone()
    for key in ("config", "ckpt_path", "resume", "__path__"):
        if key in ns:
            del ns[key]
    ns.seed_everything = seed
    return fit.dump(ns, skip_none=False, skip_check=True)
