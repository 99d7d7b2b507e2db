"""Subcommands (filled in by the module's owner)."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parent: argparse.ArgumentParser) -> None:
    return None
