"""Every error a user can cause is a tiered_ckpt.errors.UserError (one message, an exit code), so a
caller that catches UserError (the CLIs, a training script) gets it without a traceback: stack
settings refused by the program, a refused offline preview, a damaged marker."""
from __future__ import annotations

import pytest

from components.settings import schema
from tiered_ckpt.errors import EXIT_FAILED, EXIT_USAGE, IntegrityError, UserError
from tiered_ckpt.io.marker import parse_marker
from tiered_ops import mockrun
from tiered_ops.mockrun import stack_config


def test_refused_stack_settings_are_a_user_error_with_the_usage_exit_code() -> None:
    with pytest.raises(UserError) as err:
        schema.load(stack_config("prod", {"nodeCount": "eight"}), "prod")
    assert isinstance(err.value, schema.SettingsError) and err.value.exit_code == EXIT_USAGE
    assert "tiered:nodeCount" in str(err.value)


def test_a_refused_preview_is_a_user_error() -> None:
    assert issubclass(mockrun.PreviewError, UserError) and mockrun.PreviewError("x").exit_code == EXIT_USAGE


@pytest.mark.parametrize("data", [b"{", b"[]", b'{"format": "nope"}'])
def test_a_damaged_marker_is_an_integrity_error(data: bytes) -> None:
    with pytest.raises(IntegrityError) as err:
        parse_marker(data)
    assert err.value.exit_code == EXIT_FAILED and "\n" not in str(err.value)
