"""Tags on every Azure resource of the stack: stack, project and owner (cost reports, "whose is this?").

Applied by one transformation on the platform component, so every azure-native resource under it that
takes `tags` gets them, including resources added later; explicit tags a resource sets win per key.
Which resources take tags is read from the SDK: the resource class's constructor has a `tags` parameter
(ARM tracked resources; sub-resources such as subnets, containers and role assignments have none).
"""
from __future__ import annotations

import importlib
import inspect
from functools import cache
from typing import Any

import pulumi

from components.settings.schema import Settings

PROVIDER = "azure-native"
UNASSIGNED_OWNER = "unassigned"


def stack_tags(s: Settings, project: str) -> dict[str, str]:
    return {"stack": s.stack, "project": project, "owner": s.owner or UNASSIGNED_OWNER}


@cache
def taggable(type_token: str) -> bool:
    """Whether the azure-native resource type `azure-native:<module>:<Type>` accepts `tags`."""
    provider, module, name = (type_token.split(":") + ["", ""])[:3]
    if provider != PROVIDER or not module or not name:
        return False
    try:
        cls = getattr(importlib.import_module(f"pulumi_azure_native.{module}"), name)
    except (ImportError, AttributeError):
        return False
    return "tags" in inspect.signature(cls._internal_init).parameters


def tagging(tags: dict[str, str]) -> pulumi.ResourceTransformation:
    """A transformation adding `tags` to every taggable azure-native resource (and to its children)."""

    def add(args: pulumi.ResourceTransformationArgs) -> pulumi.ResourceTransformationResult | None:
        if not taggable(args.type_):
            return None
        props: dict[str, Any] = dict(args.props)
        own = props.get("tags")
        props["tags"] = pulumi.Output.from_input(own).apply(lambda t: {**tags, **(t or {})}) if own is not None else dict(tags)
        return pulumi.ResourceTransformationResult(props=props, opts=args.opts)

    return add
