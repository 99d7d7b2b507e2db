"""`tiered-ckpt`: the node toolkit's command line.

Each command lives in the module that does its job; this file only wires them and turns
user errors into one clear line and an exit code (see errors.py), never a traceback.
"""
from __future__ import annotations

import argparse
import errno
import importlib.metadata
import logging
import re
import signal
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence

from tiered_ckpt import config as config_mod
from tiered_ckpt import logs
from tiered_ckpt.cli import convert as convert_commands
from tiered_ckpt.cli import io as io_commands
from tiered_ckpt.cli import lifecycle as lifecycle_commands
from tiered_ckpt.cli import timeline as timeline_commands
from tiered_ckpt.cli.output import print_error, redact
from tiered_ckpt.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, UserError

Handler = Callable[[argparse.Namespace, config_mod.NodeConfig], int]
# A command group: adds its subcommands to the parser (`register(subparsers, common flags)`).
Registrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]", argparse.ArgumentParser], None]

# The node toolkit's command groups, registered by direct import (an import error is an error here).
COMMANDS: tuple[Registrar, ...] = (
    io_commands.register,          # bench, list, verify
    lifecycle_commands.register,   # retention, restore, status, export
    timeline_commands.register,    # timeline
    convert_commands.register,     # convert (torch inside the command only)
)

# In a help text, "{config:io.threads}" becomes the setting's effective value and where it comes
# from ("8 from /etc/tiered-ckpt/config.yaml"), so help shows what a run would use.
_SETTING = re.compile(r"\{config:([a-z_.]+)\}")


def common_parser() -> argparse.ArgumentParser:
    """The global flags, one line each. They are accepted before and after the subcommand: the
    top-level parser has them with these defaults, every subcommand with SUPPRESS defaults."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config", help=f"node config file (default: ${config_mod.ENV_VAR} or {config_mod.DEFAULT_PATH})")
    p.add_argument("--root", help="checkpoint root on the accelerator layer (default: {config:root})")
    p.add_argument("--model", help="model directory under the root (default: {config:model})")
    p.add_argument("--backend", choices=("amlfs", "local"), help="tier back-end (default: {config:backend})")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.add_argument("--log-format", choices=logs.FORMATS,
                   help="log records on stderr: text (default) or json (one object per line: ts, level, logger, "
                        "message, model, checkpoint, operation, duration_s, bytes, outcome)")
    p.add_argument("--log-level", choices=logs.LEVELS,
                   help="the toolkit's log level (default: info with --log-format json, else warning)")
    return p


def _version() -> str:
    try:
        return importlib.metadata.version("tiered-ckpt")
    except importlib.metadata.PackageNotFoundError:     # run from a source tree that was never installed
        return "unknown (not installed)"


def _children(p: argparse.ArgumentParser) -> list[tuple[argparse.ArgumentParser, str]]:
    """A parser's subcommands (each once, whatever its aliases) with their one-line help."""
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            helps = {c.dest: c.help or "" for c in a._choices_actions}
            seen: dict[int, tuple[argparse.ArgumentParser, str]] = {}
            for name, child in a.choices.items():
                seen.setdefault(id(child), (child, helps.get(name, "")))
            return list(seen.values())
    return []


def _all_parsers(p: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield p
    for child, _ in _children(p):
        yield from _all_parsers(child)


def _leaves(p: argparse.ArgumentParser, about: str = "") -> Iterator[tuple[argparse.ArgumentParser, str]]:
    """The runnable subcommands under `p` (each with its help line)."""
    children = _children(p)
    if not children:
        yield p, about
    for child, text in children:
        yield from _leaves(child, text)


def _group_epilog(group: argparse.ArgumentParser, globals_: set[str]) -> str:
    """For `tiered-ckpt retention --help`: each subcommand under the group, its usage and its own
    flags (the global ones are listed once, above)."""
    out = ["subcommands and their flags (global flags work before or after the subcommand):"]
    for leaf, about in _leaves(group):
        fmt = leaf._get_formatter()
        fmt.add_usage(leaf.usage, leaf._actions, leaf._mutually_exclusive_groups, prefix="usage: ")
        fmt.start_section(None)
        fmt.add_arguments([a for a in leaf._actions
                           if not set(a.option_strings) & globals_ and not isinstance(a, argparse._HelpAction)])
        fmt.end_section()
        out.append(f"\n{leaf.prog.removeprefix(group.prog).strip()}: {about}\n{fmt.format_help().rstrip()}")
    return "\n".join(out)


def _finish(parser: argparse.ArgumentParser, cfg: config_mod.NodeConfig) -> None:
    """What every subcommand gets whoever registered it: the global flags (SUPPRESS defaults,
    so a flag given before the subcommand is not reset by the subcommand's default), help texts
    with the config's effective defaults, and group help that lists the subcommands' flags."""
    template = _suppressed(common_parser())
    globals_ = {o for a in template._actions for o in a.option_strings}
    root = parser
    for p in _all_parsers(parser):
        if p is not root:
            for a in template._actions:
                if not any(o in p._option_string_actions for o in a.option_strings):
                    p._add_action(a)
        for a in p._actions:
            if a.help and "{config:" in a.help:
                a.help = _SETTING.sub(lambda m: config_mod.show_setting(cfg, m.group(1)).replace("%", "%%"), a.help)
    for p in _all_parsers(parser):
        if p is not root and _children(p):
            p.formatter_class = argparse.RawDescriptionHelpFormatter
            p.epilog = _group_epilog(p, globals_)


def _suppressed(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    for a in p._actions:
        a.default = argparse.SUPPRESS
    return p


def build_parser(commands: Sequence[Registrar] = COMMANDS, prog: str = "tiered-ckpt",
                 cfg: config_mod.NodeConfig | None = None) -> argparse.ArgumentParser:
    """The command line; `cfg` (the loaded node config) supplies the defaults its help shows."""
    parser = argparse.ArgumentParser(
        prog=prog, parents=[common_parser()],
        description="Checkpoint I/O, archive proof, retention and restore on the accelerator layer (AMLFS) and Blob.",
    )
    parser.add_argument("--version", action="version", version=f"{prog} {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    parent = _suppressed(common_parser())
    for register in commands:
        register(sub, parent)
    _finish(parser, cfg if cfg is not None else config_mod.NodeConfig())
    return parser


def _preload(argv: Sequence[str] | None) -> tuple[config_mod.NodeConfig | None, UserError | None]:
    """The node config named by --config (wherever it is on the line), loaded before parsing so
    that help can show its defaults; a config error is kept for the command to report."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    try:
        return config_mod.load(known.config), None
    except UserError as e:
        return None, e


def load_config(args: argparse.Namespace, loaded: config_mod.NodeConfig | None = None) -> config_mod.NodeConfig:
    cfg = loaded if loaded is not None else config_mod.load(args.config)
    return cfg.with_overrides(
        root=getattr(args, "root", None),
        model=getattr(args, "model", None),
        backend=getattr(args, "backend", None),
    )


# errno -> (what it means for the user, exit code). The path's mount or permissions are the
# user's to fix (EXIT_USAGE); a full or failing device is an operation that failed.
_OS_ERRORS = {
    errno.EROFS: ("the file system is mounted read-only; remount it read-write (or use another --root)", EXIT_USAGE),
    errno.EACCES: ("permission denied; run as a user that may write there, or fix the directory's permissions", EXIT_USAGE),
    errno.EPERM: ("operation not permitted (an immutable file or directory, or a permission the user lacks); "
                  "check `lsattr -d` and the permissions", EXIT_USAGE),
    errno.ENOENT: ("no such file or directory; check the path (--root, --config) and that the file system is mounted",
                   EXIT_USAGE),
    errno.ENOTDIR: ("a component of the path is not a directory; check the path", EXIT_USAGE),
    errno.ENOSPC: ("no space left on the device; free space (retention apply) or grow the file system", EXIT_FAILED),
    errno.EDQUOT: ("disk quota exceeded; free space or raise the quota", EXIT_FAILED),
    errno.ENOMEM: ("out of memory; lower io.threads, io.block_size or io.staging_bytes", EXIT_FAILED),
    errno.EIO: ("an I/O error from the device; check the file system (dmesg, lfs check servers)", EXIT_FAILED),
}


def os_error_message(e: OSError, cfg: config_mod.NodeConfig | None = None) -> tuple[str, int]:
    """One line for an OSError that reached the command line: the path, the errno and the fix."""
    name = errno.errorcode.get(e.errno or 0, "") if e.errno else ""
    paths = [str(p) for p in (e.filename, e.filename2) if p is not None]
    where = " -> ".join(paths) if paths else (f"a file under the checkpoint root {cfg.root}" if cfg else "a file")
    hint, code = _OS_ERRORS.get(e.errno or -1, ("check the path and the file system", EXIT_FAILED))
    reason = e.strerror or str(e) or type(e).__name__
    return f"{where}: {reason}{f' ({name})' if name else ''}: {hint}", code


def main(argv: Sequence[str] | None = None, *, commands: Sequence[Registrar] = COMMANDS, prog: str = "tiered-ckpt") -> int:
    """Run one command; `commands`/`prog` let the demo and operator packages reuse this edge."""
    loaded, config_error = _preload(argv)
    parser = build_parser(commands, prog, loaded)
    args = parser.parse_args(argv)
    as_json = bool(getattr(args, "json", False))
    # Log records (the Azure SDK's warnings included) go through the same redaction as output.
    # JSON lines are for journald/log shippers: one record per operation at INFO. Text is for a
    # person at a terminal, who reads the command's own output: warnings and errors only.
    log_format = getattr(args, "log_format", None) or "text"
    logs.configure(log_format, getattr(args, "log_level", None) or ("info" if log_format == "json" else "warning"))
    # SIGTERM (systemd stop, kill) takes the same clean-up path as Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    cfg: config_mod.NodeConfig | None = None
    try:
        if config_error is not None:
            raise config_error
        cfg = load_config(args, loaded)
        handler: Handler = args.handler
        return int(handler(args, cfg) or 0)
    except UserError as e:
        print_error(str(e), as_json=as_json, exit_code=e.exit_code)
        return e.exit_code
    except KeyboardInterrupt:
        print_error("interrupted; nothing committed was changed", as_json=as_json, exit_code=EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED
    except OSError as e:
        # The environment, not a bug: a read-only or full file system, a permission.
        msg, code = os_error_message(e, cfg)
        print_error(msg, as_json=as_json, exit_code=code)
        return code
    except Exception:
        # A bug. Its traceback helps the report, but it may quote a URL with a SAS token.
        if logs.json_active():
            logging.getLogger("tiered_ckpt.cli").error("internal error", exc_info=True)
        else:
            sys.stderr.write(redact(traceback.format_exc()))
        print_error("internal error (the traceback above); please report it", as_json=as_json, exit_code=EXIT_FAILED)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
