"""Command-line options generated from a :class:`~npu_core.config.StrictConfig`, for typer apps.

Every CLI of the workspace configures its run the same way: the settings model's fields are the
options (their descriptions are the ``--help``), ``--config FILE.toml`` and repeatable
``--set section.field=value`` reach every field, including those without an option of their own.
Precedence, lowest first: the model's defaults (or a base the command picks, e.g. a preset), the
TOML file, ``--set``, then options given explicitly. A bad value stops the command before any
work with one line on stderr naming the key, the value and what is allowed, and exit code 2
(:func:`fail`), the convention of every CLI here. That holds for the values typer parses too
(``--height abc``, an unknown option): every console script's ``main()`` is :func:`run_app`.

    @app.command()
    @config_options(GenerateOptions, flags={"out": "--out"})
    def generate(config: GenerateOptions, overwrite: bool = False) -> None: ...

    def main() -> None:
        run_app(app)
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from typer.core import TyperGroup

from npu_core import env
from npu_core.config import ConfigError, StrictConfig, layer_tree, set_dotted
from npu_core.dist.failure import describe

try:  # typer 0.2x parses with its own copy of click, whose errors are not click's classes
    from typer._click import exceptions as click_errors
except ImportError:  # older typer: click itself
    from click import exceptions as click_errors  # type: ignore[no-redef]

EXIT_USAGE = 2
"""Exit code of a refused input, as click uses for usage errors."""

_CONFIG_FILE = "config_file_"
_SET_ITEMS = "set_items_"

BaseFactory = Callable[[dict[str, Any]], StrictConfig | None]
"""Picks the starting configuration from the command's own arguments (e.g. a preset name)."""


_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")
_KEPT_LINE = re.compile(r"[ \t]|[-*•] |\d+[.)] ")
"""A line that keeps its newline: indented (an example) or a list item."""


def prose(text: str | None) -> str | None:
    """Help text with each paragraph joined into one line, for rich to wrap to the terminal.

    Docstrings are wrapped at the source's line length; typer's rich help keeps such a single
    newline as a hard break and wraps again at the terminal's width on top of it, which cuts
    sentences ("... optionally weights and" / "tokenizer files) ..."). Joining the lines of a
    paragraph leaves the wrapping to rich, while what is meant as layout stays: blank lines
    between paragraphs, a paragraph that starts with ``\\b`` (click's mark for lines kept as
    written), list items and indented lines (examples), and everything after ``\\f`` (click
    shows none of it). The text is dedented first, as typer does.

    Args:
        text: a command's help (its docstring or ``help=``); None stays None.

    Returns:
        The same paragraphs, each a single line except for the kept breaks above.
    """
    if text is None:
        return None
    head, cut, tail = inspect.cleandoc(text).partition("\f")
    body = head.rstrip()
    paragraphs = []
    for paragraph in _PARAGRAPH_BREAK.split(body):
        if paragraph.startswith("\b"):
            paragraphs.append(paragraph)
            continue
        first, *rest = paragraph.split("\n")
        joined = [first]
        for line in rest:
            if _KEPT_LINE.match(line):
                joined.append(line)
            else:
                joined[-1] = f"{joined[-1].rstrip()} {line.strip()}"
        paragraphs.append("\n".join(joined))
    return "\n\n".join(paragraphs) + head[len(body) :] + cut + tail


class HelpGroup(TyperGroup):
    """typer's group whose help, and that of every command under it, is :func:`prose`.

    Every app of the workspace passes it as ``typer.Typer(cls=HelpGroup)``, so that the
    docstrings can stay wrapped for the source while ``--help`` wraps them for the terminal.
    typer builds the commands before their group, so the group rewrites them all here, nested
    groups included; an app of a single command without a callback is no group and misses it.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        _prose_help(self)


def _prose_help(command: Any) -> None:
    command.help = prose(command.help)
    for sub in getattr(command, "commands", {}).values():
        _prose_help(sub)


def fail(message: str, *, code: int = EXIT_USAGE) -> NoReturn:
    """Print ``error: message`` as one line on stderr and exit with ``code``.

    The one way every CLI of the workspace reports a refusal or a failure. Under torchrun each
    rank runs the same command line and reaches the same refusal, so only rank 0 prints it: the
    user reads one line, not one per rank.

    Args:
        message: the cause and, where there is one, the fix (``--out x is a file; ...``).
        code: the exit status: 2 (the default) for input refused before any work, 1 for work
            that failed.
    """
    if env.launch_rank() == 0:
        typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


EXIT_FAILED = 1
"""Exit code of work that started and failed."""


@contextlib.contextmanager
def rank_failures(log_dir: Path) -> Iterator[None]:
    """Report a failed multi-rank job as one ``error:`` line; keep its traceback in ``log_dir``.

    The line names the rank that failed first and the cause (out of memory, no space, a
    signal, a stopped rank, or the exception's type and message) and points to
    ``log_dir/rank<N>.log``, which holds the rank's whole traceback. Exit status 1. Used around
    the launch of every multi-rank CLI, so that a failure reads the same everywhere.

    Args:
        log_dir: where the traceback is kept, normally ``<run folder>/logs``.
    """
    try:
        yield
    except (typer.Exit, typer.Abort, click_errors.ClickException):
        raise  # the CLI's own exits and refusals are already one line
    except Exception as exc:
        failure = describe(exc)
        try:
            log: Path | None = failure.write(log_dir)
        except OSError:  # e.g. the disk that filled up: the line alone must do
            log = None
        fail(failure.line(log), code=EXIT_FAILED)


def run_app(
    app: typer.Typer, args: Sequence[str] | None = None, *, prog_name: str | None = None
) -> NoReturn:
    """Run a typer app as a console script: a refused command line is one line, exit 2.

    click reports a value it cannot parse (``--height abc``), an unknown option or a missing
    argument as a boxed usage block over several lines; every other refusal here is
    ``error: ...`` on one line (:func:`fail`), so this runs the app in click's non-standalone
    mode and prints such a usage error the same way (click's own message: the
    option, the value and what it accepts). Everything else keeps typer's handling: ``--help``,
    a group called without a command (its help), ``typer.Exit`` codes, other click errors,
    Ctrl-C (exit 130) and the pretty tracebacks of unexpected exceptions.

    Args:
        app: the package's typer app.
        args: the command line without the program name (None: ``sys.argv[1:]``).
        prog_name: the name usage lines show (None: detected from ``sys.argv``).

    Exits with the command's status: 0, the code of a ``typer.Exit`` it raised, 2 for a refused
    command line. Commands here return None; a command returning an int would make it the
    status, as click does in this mode.
    """
    try:
        result = app(args=args, prog_name=prog_name, standalone_mode=False)
    except click_errors.NoArgsIsHelpError as exc:
        _show_click_error(app, exc)
        sys.exit(exc.exit_code)
    except click_errors.UsageError as exc:
        # outside click's main a typer.Exit (what fail raises) would not become the status
        typer.echo(f"error: {_usage_message(exc)}", err=True)
        sys.exit(EXIT_USAGE)
    except click_errors.ClickException as exc:
        _show_click_error(app, exc)
        sys.exit(exc.exit_code)
    except typer.Abort:
        rich_utils = _rich_utils(app)
        if rich_utils is None:
            typer.echo("Aborted!", err=True)
        else:
            rich_utils.rich_abort_error()
        sys.exit(1)
    sys.exit(result if isinstance(result, int) and not isinstance(result, bool) else 0)


def _usage_message(exc: click_errors.UsageError) -> str:
    """click's message on one line, with the refused value where the message lacks it.

    typer 0.2x checks option values with pydantic and keeps only pydantic's wording ("Input
    should be a valid integer"); the value is on the ValidationError it chains.
    """
    cause = exc.__cause__
    if isinstance(exc, click_errors.BadParameter) and isinstance(cause, ValidationError):
        inputs = [error["input"] for error in cause.errors() if "input" in error]
        if inputs:
            exc.message = f"{inputs[0]!r}: {exc.message}"
    return " ".join(exc.format_message().split())


def _show_click_error(app: typer.Typer, exc: click_errors.ClickException) -> None:
    """Print a click error as a standalone typer app would (help text, or typer's error box)."""
    rich_utils = _rich_utils(app)
    if isinstance(exc, click_errors.NoArgsIsHelpError) or rich_utils is None:
        exc.show()
    else:
        rich_utils.rich_format_error(exc)


def _rich_utils(app: typer.Typer) -> types.ModuleType | None:
    """typer's rich rendering where the app uses it (typer falls back to click's without rich)."""
    if app.rich_markup_mode is None:
        return None
    try:
        from typer import rich_utils
    except ImportError:
        return None
    return rich_utils


def config_options(
    model: type[StrictConfig],
    *,
    flags: Mapping[str, str] | None = None,
    exclude: tuple[str, ...] = (),
    base: BaseFactory | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a typer command so that it takes ``config: model`` built from the command line.

    Args:
        model: the settings class; each scalar leaf field becomes an option, ``--field-name``
            for top-level fields and ``--section.field-name`` for nested ones.
        flags: dotted field -> option name, where a shorter or historical name reads better
            (``{"parallel.nproc": "--nproc"}``).
        exclude: dotted fields (or whole sections) without an option; ``--set`` still reaches them.
        base: called with the command's own arguments; returns the configuration the layers go
            on top of (None: the model's defaults).

    The decorated function must have a parameter named ``config``; its other parameters stay
    options or arguments of their own and are passed through unchanged.
    """
    flags = dict(flags or {})
    unknown = [key for key in (*flags, *exclude) if not _has_field(model, key)]
    if unknown:
        raise ValueError(f"{model.__name__} has no field {', '.join(sorted(unknown))}")

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(func)
        if "config" not in signature.parameters:
            raise TypeError(f"{func.__name__} needs a `config` parameter to receive {model}")
        hints = typing.get_type_hints(func, include_extras=True)
        # resolved annotations: under `from __future__ import annotations` they are strings,
        # and typer would not see the typer.Option (help, aliases) inside an Annotated string
        own = [
            p.replace(annotation=hints.get(p.name, p.annotation))
            for p in signature.parameters.values()
            if p.name != "config"
        ]
        generated = {
            _param_name(path): (path, _option_parameter(path, field, flags))
            for path, field in _leaf_fields(model)
            if not _excluded(path, exclude) and _option_type(field.annotation) is not None
        }
        layers = [
            inspect.Parameter(
                _CONFIG_FILE,
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[
                    Path | None,
                    typer.Option("--config", help="TOML file; its tables mirror the sections."),
                ],
            ),
            inspect.Parameter(
                _SET_ITEMS,
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[
                    list[str] | None,
                    typer.Option(
                        "--set",
                        help="Override any field, repeatable: --set section.field=value "
                        '(TOML values: 3, 0.5, true, "text", [1, 2]).',
                    ),
                ],
            ),
        ]

        @functools.wraps(func)
        def command(**kwargs: Any) -> Any:
            toml_path = kwargs.pop(_CONFIG_FILE)
            overrides = kwargs.pop(_SET_ITEMS) or []
            explicit = {
                ".".join(path): kwargs.pop(name)
                for name, (path, _) in generated.items()
                if kwargs.get(name) is not None
            }
            for name in generated:
                kwargs.pop(name, None)
            try:
                start = base(dict(kwargs)) if base is not None else None
                tree = layer_tree(start, toml_path, overrides)
                for key, value in explicit.items():
                    set_dotted(tree, key, value.value if isinstance(value, enum.Enum) else value)
                config = model.validate_tree(tree)
            except ConfigError as exc:
                fail(str(exc))
            return func(config=config, **kwargs)

        params = own + [param for _, param in generated.values()] + layers
        command.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {
            **{k: v for k, v in hints.items() if k != "config"},
            **{p.name: p.annotation for p in params[len(own) :]},
        }
        return command

    return decorate


def _leaf_fields(
    model: type[BaseModel], prefix: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], FieldInfo]]:
    """Depth-first (dotted path, field) for every field that is not itself a section."""
    for name, field in model.model_fields.items():
        path = (*prefix, name)
        section = _section_model(field.annotation)
        if section is not None:
            yield from _leaf_fields(section, path)
        else:
            yield path, field


def _section_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _has_field(model: type[BaseModel], dotted: str) -> bool:
    node: type[BaseModel] | None = model
    for part in dotted.split("."):
        if node is None or part not in node.model_fields:
            return False
        node = _section_model(node.model_fields[part].annotation)
    return True


def _excluded(path: tuple[str, ...], exclude: tuple[str, ...]) -> bool:
    dotted = ".".join(path)
    return any(dotted == item or dotted.startswith(item + ".") for item in exclude)


def _param_name(path: tuple[str, ...]) -> str:
    return "cfg__" + "__".join(path)


def _option_type(annotation: Any) -> Any:
    """The type typer parses for a field, or None when only ``--set`` can express it.

    Optional scalars keep their scalar; Literal and Enum choices are parsed as text and
    validated by the model, whose error lists the allowed values.
    """
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _option_type(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return _option_type(members[0]) if len(members) == 1 else None
    if origin is typing.Literal:
        return str
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return str
    if annotation in (bool, int, float, str, Path):
        return annotation
    return None


def _choices(annotation: Any) -> list[str]:
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _choices(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [c for arg in typing.get_args(annotation) for c in _choices(arg)]
    if origin is typing.Literal:
        return [str(arg) for arg in typing.get_args(annotation)]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [str(member.value) for member in annotation]
    return []


def _option_parameter(
    path: tuple[str, ...], field: FieldInfo, flags: Mapping[str, str]
) -> inspect.Parameter:
    dotted = ".".join(path)
    kind = _option_type(field.annotation)
    name = flags.get(dotted) or "--" + ".".join(part.replace("_", "-") for part in path)
    decls = [f"{name}/--no-{name.removeprefix('--')}"] if kind is bool else [name]
    help_text = (field.description or "").rstrip()
    choices = _choices(field.annotation)
    if choices:
        help_text += f" One of: {', '.join(choices)}."
    if not field.is_required():
        default = field.get_default(call_default_factory=True)
        shown = default.value if isinstance(default, enum.Enum) else default
        help_text += f" (default: {shown})"
    panel = path[0].replace("_", " ").capitalize() if len(path) > 1 else None
    option = typer.Option(*decls, help=help_text.strip(), rich_help_panel=panel)
    return inspect.Parameter(
        _param_name(path),
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[kind | None, option],
    )
