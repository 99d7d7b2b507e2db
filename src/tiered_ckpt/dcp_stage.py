"""placeholder"""
from __future__ import annotations


def notify_written() -> None:
    pass
