"""Pulumi program: validated settings -> Platform component -> stack outputs. Wiring only."""
from pathlib import Path

import pulumi
from pulumi.runtime import config as runtime_config

from components.resources.platform import Platform, PlatformArgs
from components.settings.schema import NAMESPACE, SCHEMA, SettingsError, load

ROOT = Path(__file__).resolve().parent


def _raw_config() -> dict[str, object]:
    cfg = pulumi.Config(NAMESPACE)
    raw: dict[str, object] = {k.name: v for k in SCHEMA if (v := cfg.get(k.name)) is not None}
    # Every set `tiered:` key, so a misspelt key is an error instead of a silently ignored setting.
    for key in {**runtime_config.get_config_env(), **runtime_config.CONFIG.get()}:
        if key.startswith(NAMESPACE + ":") and key.split(":", 1)[1] not in raw:
            raw[key] = cfg.get(key.split(":", 1)[1])
    return raw


try:
    settings = load(_raw_config(), pulumi.get_stack())
except SettingsError as err:
    # RunError: Pulumi prints the message alone, no traceback, and the update stops before any resource.
    raise pulumi.RunError(str(err)) from None

platform = Platform("tiered", PlatformArgs(settings=settings, repo_root=ROOT, build_dir=ROOT / "build" / "toolkit"))
for name, value in platform.outputs.items():
    pulumi.export(name, value)
