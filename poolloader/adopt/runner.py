"""`python -m poolloader [options] SCRIPT [ARGS...]` (or `-m MODULE`, or `poolloader-run`):
run a training script you do not own with every DataLoader it builds running as a PoolLoader.

The script runs as `python SCRIPT ARGS...` would run it: in a fresh `__main__` module
that stays `sys.modules["__main__"]`, with `sys.argv == [SCRIPT, *ARGS]`, the script's
directory as `sys.path[0]`, its exit code, and an uncaught exception printed by
`sys.excepthook` with the script's frames only (the runner's are cut off), KeyboardInterrupt
included (the process then dies of SIGINT as python's does). `-m MODULE` runs like
`python -m MODULE` (runpy, the current directory as `sys.path[0]`).

What changes (`--loader pool`, the default): see `poolloader.adopt.hook` — every
`DataLoader(..., num_workers > 0)` built in this process or its multiprocessing
children is a PoolLoader with the pool options given here; at exit (and on SIGUSR1,
if the script has no handler of its own) a summary per loader goes to stderr (the
first and last `hook.LISTED` of each kind; those between are counted and added up, so
a script that builds thousands of loaders keeps a summary, and a memory, of bounded size).
`--loader torch` changes nothing: the script runs exactly as under python, so an A/B
comparison is one flag.

Pool options: every keyword PoolLoader has beyond DataLoader's (`slot_bytes`, `slots`,
`shm_limit`, ...), as `--slot-bytes N` or `POOLLOADER_SLOT_BYTES=N` (the flag wins);
values are numbers, `none`, or text (`--device cuda`); a switch (`--stateful`) takes
true/false/1/0 in any case; `--share-batches` takes global ranks separated by commas
(`0,1`: `share_batches=[0, 1]`). Options not given keep
PoolLoader's defaults. The summary ends each loader with `stats.advice()`.
"""
from __future__ import annotations

import argparse
import builtins
import importlib.util
import inspect
import os
import re
import signal
import sys
import types
import zipfile
from importlib.machinery import SourceFileLoader
from typing import Any

from poolloader.adopt import hook
from poolloader.loader import PoolLoader

ENV_PREFIX = "POOLLOADER_"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m poolloader",
        usage="python -m poolloader [options] (SCRIPT | -m MODULE) [ARGS ...]",
        description="Run SCRIPT (or -m MODULE) as python would, with every DataLoader it builds "
                    "with num_workers > 0 built as a PoolLoader.",
        epilog="Pool options may also come from the environment: "
               + ", ".join(ENV_PREFIX + n.upper() for n in hook.runner_option_names())
               + " (a flag wins). SIGUSR1 prints the summary while the script runs.")
    p.add_argument("--loader", choices=("pool", "torch"), default="pool",
                   help="pool (default): DataLoaders become PoolLoaders; torch: run the "
                        "script unchanged (the A/B baseline)")
    p.add_argument("--no-summary", dest="summary", action="store_false",
                   help="no summary at exit, no SIGUSR1 handler")
    group = p.add_argument_group("pool options (PoolLoader keyword arguments)")
    defaults = inspect.signature(PoolLoader.__init__).parameters
    for name in hook.runner_option_names():
        if name in hook.SWITCH_OPTIONS:
            group.add_argument(_flag(name), dest=name, action="store_const", const="true",
                               default=None,
                               help=f"PoolLoader(..., {name}=True); env {ENV_PREFIX}"
                                    f"{name.upper()} (true, false, 1 or 0)")
            continue
        if name in hook.AUTO_ONLY_OPTIONS:
            group.add_argument(_flag(name), dest=name, metavar="auto", default=None,
                               help=f"PoolLoader(..., {name}='auto') for every loader (a count "
                                    f"belongs to one loader: pass it in the script); env "
                                    f"{ENV_PREFIX}{name.upper()}")
            continue
        if name in hook.RANK_LIST_OPTIONS:
            group.add_argument(_flag(name), dest=name, metavar="RANKS", default=None,
                               help=f"PoolLoader(..., {name}=[RANKS]): global ranks separated "
                                    f"by commas (0,1); env {ENV_PREFIX}{name.upper()}")
            continue
        switch = isinstance(defaults[name].default, bool) or name in hook.BOOLEAN_OPTIONS
        group.add_argument(_flag(name), dest=name, metavar="true|false" if switch else "VALUE",
                           default=None,
                           help=f"PoolLoader(..., {name}=VALUE); env {ENV_PREFIX}{name.upper()}"
                                + (" (true, false, 1 or 0)" if switch else ""))
    return p


def split_argv(argv: list[str]) -> tuple[list[str], str | None, str | None, list[str]]:
    """(runner options, script, module, script args): the runner's options end at the
    first argument that is not one of them; everything after SCRIPT / `-m MODULE` is the
    script's, even if it looks like a runner option (`--loader torch`)."""
    takes_value = {"--loader"} | {_flag(n) for n in hook.runner_option_names()
                                  if n not in hook.SWITCH_OPTIONS}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            if i + 1 >= len(argv):
                _parser().error("-m needs a module name")
            return argv[:i], None, argv[i + 1], argv[i + 2:]
        if arg == "--":
            if i + 1 >= len(argv):
                _parser().error("-- needs a script")
            return argv[:i], argv[i + 1], None, argv[i + 2:]
        if arg.startswith("-") and arg != "-":
            i += 2 if arg in takes_value else 1
            continue
        return argv[:i], arg, None, argv[i + 1:]
    return argv, None, None, []


def _value(text: str):
    if text.strip().lower() == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


_BOOLEANS = {"true": True, "false": False, "1": True, "0": False}


def _ranks(name: str, text: str, source: str) -> list[int] | None:
    """The global ranks in `text` ("0,1"; "none": None), or exit naming `source`."""
    if text.strip().lower() == "none":
        return None
    parts = [part.strip() for part in text.split(",")]
    ranks = [int(part) for part in parts if re.fullmatch(r"[0-9]+", part)]
    if len(ranks) != len(parts) or len(set(ranks)) != len(ranks):
        _parser().error(f"{source}: {name} takes distinct global ranks (whole numbers >= 0) "
                        f"separated by commas, e.g. 0,1; got {text!r}")
    return ranks


def pool_options(parsed: argparse.Namespace, environ=os.environ) -> dict:
    """The pool options given by flag or environment variable, checked by building a
    PoolLoader with them (so a bad value fails here, naming where it came from). An
    option whose default is True or False (`stateful`) takes true/false/1/0, any case;
    share_batches a list of global ranks separated by commas."""
    options: dict[str, Any] = {}
    sources, texts = {}, {}
    for name in hook.runner_option_names():
        flag_value, env = getattr(parsed, name), ENV_PREFIX + name.upper()
        if flag_value is not None:
            texts[name], sources[name] = flag_value, f"{_flag(name)} {flag_value}"
        elif environ.get(env, "") != "":
            texts[name], sources[name] = environ[env], f"{env}={environ[env]}"
    defaults = inspect.signature(PoolLoader.__init__).parameters
    for name, text in texts.items():
        if (isinstance(defaults[name].default, bool) or name in hook.SWITCH_OPTIONS
                or name in hook.BOOLEAN_OPTIONS):
            if text.strip().lower() not in _BOOLEANS:
                _parser().error(f"{sources[name]}: {name} must be one of true, false, 1, 0 "
                                f"(any case), got {text!r}")
            options[name] = _BOOLEANS[text.strip().lower()]
        elif name in hook.RANK_LIST_OPTIONS:
            options[name] = _ranks(name, text, sources[name])
        elif name in hook.AUTO_ONLY_OPTIONS:
            if text.strip().lower() not in ("auto", "none"):
                _parser().error(f"{sources[name]}: the runner takes {name}=auto (or none) for "
                                f"every loader, got {text!r}: a count is bounded by each "
                                f"loader's num_workers, so pass {name}=P to that PoolLoader "
                                f"in the script")
            options[name] = None if text.strip().lower() == "none" else "auto"
        else:
            options[name] = _value(text)
    for name, value in options.items():
        if name in hook.AUTO_ONLY_OPTIONS:
            continue  # checked above (PoolLoader(num_workers=0) takes no "auto")
        if name in hook.RANK_LIST_OPTIONS:
            continue  # checked by _ranks (under torchrun, the check's PoolLoader(num_workers=0)
            # would be refused as a member of its group)
        default = defaults[name].default
        expected = (int, float) if isinstance(default, float) else type(default)
        if None not in (default, value) and not isinstance(value, expected):
            _parser().error(f"{sources[name]}: {name} must be of type {type(default).__name__}, "
                            f"as PoolLoader's default {default!r}")
        try:
            PoolLoader([0], num_workers=0, **{name: value})
        except (TypeError, ValueError) as exc:
            _parser().error(f"{sources[name]}: {exc}")
    return options


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    own, script, module, script_args = split_argv(argv)
    parsed = _parser().parse_args(own)
    if script is None and module is None:
        _parser().error("give a SCRIPT to run (or -m MODULE)")
    summary = False
    if parsed.loader == "pool":
        hook.enable(pool_options(parsed), report=parsed.summary)
        summary = parsed.summary
    try:
        if module is not None:
            _run_module(module, script_args, summary)
        elif script is not None:
            _run_script(script, script_args, summary)
    except SystemExit:
        raise
    except BaseException:
        _cut_runner_frames_when_uncaught()
        raise


# -- running the script as python does ---------------------------------------------------

def _start_summary() -> None:
    """The summary at exit and on SIGUSR1 (if the script's SIGUSR1 is still the default);
    called once the script is found, so a typo in its name prints only python's error."""
    hook.print_summary_at_exit()
    if signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL:
        signal.signal(signal.SIGUSR1, lambda signum, frame: hook.print_summary())


def _fresh_main() -> types.ModuleType:
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    return main


def _set_path0(entry: str) -> None:
    """What python puts first on sys.path for the script; replaces the runner's own entry
    (the current directory under `python -m poolloader`, the bin directory under
    `poolloader-run`). Nothing under -P (safe_path), as python."""
    if getattr(sys.flags, "safe_path", False):
        return
    if sys.path:
        sys.path[0] = entry
    else:
        sys.path.insert(0, entry)


def _run_script(path: str, args: list[str], summary: bool) -> None:
    sys.argv = [path, *args]
    if os.path.isdir(path) or (os.path.isfile(path) and zipfile.is_zipfile(path)):
        # `python DIR` / `python app.zip`: DIR/__main__.py runs as the main module.
        import runpy
        _set_path0(path)
        _fresh_main()
        if summary:
            _start_summary()
        runpy._run_module_as_main("__main__", alter_argv=False)  # type: ignore[attr-defined]
        return
    filename = os.path.abspath(path)
    try:
        with open(filename, "rb") as f:
            source = f.read()
    except OSError as exc:
        print(f"{sys.executable}: can't open file {filename!r}: [Errno {exc.errno}] {exc.strerror}",
              file=sys.stderr)
        raise SystemExit(2) from None
    _set_path0(os.path.dirname(os.path.realpath(path)))
    main = _fresh_main()
    main.__dict__.update(__file__=filename, __cached__=None, __package__=None, __spec__=None,
                         __loader__=SourceFileLoader("__main__", filename))
    code = compile(source, filename, "exec", dont_inherit=True)
    if summary:
        _start_summary()
    exec(code, main.__dict__)  # noqa: S102 -- running the script is the point


def _run_module(name: str, args: list[str], summary: bool) -> None:
    import runpy
    sys.argv = ["-m", *args]  # runpy sets argv[0] to the module's file, as python -m does
    _set_path0(os.getcwd())
    _fresh_main()
    if summary:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False  # runpy says why, as python -m does
        if found:
            _start_summary()
    runpy._run_module_as_main(name, alter_argv=True)  # type: ignore[attr-defined]


def _cut_runner_frames_when_uncaught() -> None:
    """Called while an exception leaves the script: when it reaches the top, python hands
    it to sys.excepthook (whatever the script installed); hand it over with the traceback
    cut after the last runner frame, so it reads as under `python SCRIPT`."""
    hook = sys.excepthook

    def excepthook(exc_type, exc, tb):
        cut = tb
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == __file__:
                cut = tb.tb_next
            tb = tb.tb_next
        if isinstance(exc, BaseException):
            exc.__traceback__ = cut
        hook(exc_type, exc, cut)

    sys.excepthook = excepthook


if __name__ == "__main__":
    main()
