"""``mmmeshctl``: the operator's CLI for qosd, mmmesh's node daemon (kubectl-like).

It talks to qosd's admin API (qosd/api.py): on the node through the unix
socket (``--socket``, default /run/mmmesh/qosd.sock, root only), or from
elsewhere over TCP (``--server http://node:8470 --token T``).

Exit codes (distinct, for scripts):

    0  ok
    1  anything else (dataplane failure on the node, internal error, ...)
    2  usage error (bad options, unreadable file)
    3  the policy was rejected (HTTP 422: invalid, or not realisable on the node)
    4  conflict: the policy changed since --base-version (HTTP 409)
    5  qosd unreachable (no socket, connection refused, timeout)
    6  not found (no policy yet, no such version; HTTP 404)
    7  authentication failed (HTTP 401, or no permission on the socket)

Why this module is frugal with imports
--------------------------------------
The latency an operator feels for a policy change is from typing
``mmmeshctl policy apply -f FILE`` to the kernel state being changed (the
target: p99 < 200 ms), and the CLI's own start-up is part of it.  The daemon's
side of an apply is ~80 ms; a whole ``mmmeshctl`` process used to take ~400 ms
(p50, against an API that answers at once), mostly imports: httpx ~130 ms,
the pydantic typer parses options with ~65 ms, rich ~25 ms.  Now ~120 ms, of
which the interpreter itself is ~50 ms.  So:

* HTTP is the standard library's ``http.client`` (a unix-socket connection
  subclass, plain/TLS connections for ``--server``), not httpx: one small
  JSON request per command needs no more.
* rich is imported only when something is printed as a table or in colour
  (never for ``-o json``/``-o yaml``, apply, validate, rollback).
* mmmesh.policy (pydantic) only for ``policy validate --local``.
* typer coerces option values with pydantic TypeAdapters (importing pydantic:
  the ~65 ms above); ``_FastCommand``/``_FastGroup`` below give the plain
  str/int/float/bool/Enum options a pydantic-free path for well-formed
  values and fall back to typer's own coercion (and its error messages)
  for everything else.

bench/ctl_startup.py measures whole ``mmmeshctl`` processes against qosd's API.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from typer.core import TyperCommand, TyperGroup

if TYPE_CHECKING:  # imported where used: see the module docstring
    import http.client

    from rich.console import Console, Group
    from rich.table import Table

__all__ = ["EXIT", "app", "main"]

DEFAULT_SOCKET = "/run/mmmesh/qosd.sock"
PROG = "mmmeshctl"


class EXIT:
    OK = 0
    OTHER = 1
    USAGE = 2
    REJECTED = 3
    CONFLICT = 4
    UNREACHABLE = 5
    NOT_FOUND = 6
    AUTH = 7


_HTTP_EXIT = {401: EXIT.AUTH, 403: EXIT.AUTH, 404: EXIT.NOT_FOUND, 409: EXIT.CONFLICT,
              422: EXIT.REJECTED}


class Output(str, Enum):
    table = "table"
    yaml = "yaml"
    json = "json"


class ListOutput(str, Enum):
    table = "table"
    json = "json"


# --------------------------------------------------------------------------
# Option values without pydantic
# --------------------------------------------------------------------------
_SLOW = object()  # "ask typer": the fast path does not decide this value


def _fast_coercer(descriptor: Any) -> Callable[[Any, Any], Any] | None:
    """A pydantic-free coercion for the values of one option, or None.

    It returns exactly what typer's TypeAdapter would for the values it
    accepts (str as is, ASCII decimal ints and floats within min/max, bools,
    Enum members by their exact value) and ``_SLOW`` for anything else, which
    then goes to typer's own coercion: same results, same error messages.
    """
    ann = descriptor.annotation
    info = descriptor.parameter_info
    if (descriptor.file_annotation is not None or getattr(info, "parser", None) is not None
            or getattr(info, "click_type", None) is not None or getattr(info, "clamp", False)):
        return None
    lo, hi = getattr(info, "min", None), getattr(info, "max", None)

    def in_range(v: float) -> bool:
        return (lo is None or v >= lo) and (hi is None or v <= hi)

    if ann is str and lo is None and hi is None:
        return lambda v, ctx: v if isinstance(v, str) else _SLOW
    if ann is bool and lo is None and hi is None:
        return lambda v, ctx: v if isinstance(v, bool) else _SLOW
    if ann is int:
        def to_int(v: Any, ctx: Any) -> Any:
            if isinstance(v, str):
                digits = v[1:] if v[:1] in ("+", "-") else v
                if not (digits.isascii() and digits.isdigit()):
                    return _SLOW
                v = int(v)
            elif type(v) is not int:
                return _SLOW
            return v if in_range(v) else _SLOW
        return to_int
    if ann is float:
        def to_float(v: Any, ctx: Any) -> Any:
            if isinstance(v, str):
                digits = (v[1:] if v[:1] in ("+", "-") else v).replace(".", "", 1)
                if not (digits.isascii() and digits.isdigit()):
                    return _SLOW
                v = float(v)
            elif type(v) is not float:
                return _SLOW
            return v if in_range(v) else _SLOW
        return to_float
    if (isinstance(ann, type) and issubclass(ann, Enum) and lo is None and hi is None
            and getattr(info, "case_sensitive", False)):
        by_value: dict[str, Enum] = {}
        for member in ann:
            if not isinstance(member.value, str):
                return None
            by_value.setdefault(member.value, member)

        def to_member(v: Any, ctx: Any) -> Any:
            if isinstance(v, ann):
                return v
            if isinstance(v, str) and getattr(ctx, "token_normalize_func", None) is None:
                return by_value.get(v, _SLOW)
            return _SLOW
        return to_member
    return None


class _FastRuntimeParam:
    """Stands in for typer's RuntimeParam of one single-valued option."""

    def __init__(self, descriptor: Any, fast: Callable[[Any, Any], Any],
                 build: Callable[[Any], Any]) -> None:
        self._descriptor, self._fast, self._build = descriptor, fast, build
        self._slow: Any = None

    def coerce(self, value: Any, param: Any, ctx: Any) -> Any:
        if value is None:
            return None
        out = self._fast(value, ctx)
        if out is not _SLOW:
            return out
        if self._slow is None:
            self._slow = self._build(self._descriptor)  # typer's pydantic coercion
        return self._slow.coerce(value, param=param, ctx=ctx)


def _fast_params(params: Sequence[Any]) -> None:
    """Gives the params whose values _fast_coercer handles the pydantic-free path.

    Uses typer internals (``type_descriptor``, the lazily built
    ``_runtime_param``); when they are not there (another typer), nothing
    changes but the start-up time.  tests/test_ctl.py checks that a command
    runs without importing pydantic.
    """
    try:
        from typer._coercion import build_runtime_param
    except ImportError:  # pragma: no cover - another typer
        return
    for p in params:
        desc = getattr(p, "type_descriptor", None)
        if (desc is None or getattr(p, "_runtime_param", False) is not None
                or getattr(p, "multiple", True) or getattr(p, "nargs", 0) != 1):
            continue
        fast = _fast_coercer(desc)
        if fast is not None:
            p._runtime_param = _FastRuntimeParam(desc, fast, build_runtime_param)


# typer appends its --install/--show-completion after making the group, and
# --help is made per context: the params get the fast path when parsing starts.
class _FastCommand(TyperCommand):
    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        _fast_params(self.get_params(ctx))
        return super().parse_args(ctx, args)


class _FastGroup(TyperGroup):
    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        _fast_params(self.get_params(ctx))
        return super().parse_args(ctx, args)


# --------------------------------------------------------------------------
# Talking to qosd
# --------------------------------------------------------------------------
def _err(message: str) -> None:
    typer.echo(f"{PROG}: {message}", err=True)


def fail(code: int, message: str, details: list[str] | None = None) -> NoReturn:
    """One line to stderr (plus indented details), then exit with ``code``."""
    _err(message)
    for line in details or []:
        typer.echo(f"  {line}", err=True)
    raise typer.Exit(code)


@dataclass
class Response:
    status_code: int
    content: bytes

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)  # ValueError when it is not JSON (or not UTF-8)


_NewConnection = Callable[..., "http.client.HTTPConnection"]


@functools.cache
def _connection_classes() -> tuple[_NewConnection, _NewConnection, _NewConnection | None]:
    """(unix socket, TCP, TLS or None) connection classes, made on first use.

    Each connects within ``timeout`` (``--timeout``, at most 5 s) and then
    waits up to ``read_timeout`` (``--timeout``) for each read of the answer.
    """
    import http.client
    import socket

    class UnixConnection(http.client.HTTPConnection):
        def __init__(self, path: str, *, timeout: float, read_timeout: float) -> None:
            super().__init__("qosd", timeout=timeout)
            self.unix_path = path
            self.read_timeout = read_timeout

        def connect(self) -> None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(self.timeout)
                sock.connect(self.unix_path)
                sock.settimeout(self.read_timeout)
            except BaseException:
                sock.close()
                raise
            self.sock = sock

    class TcpConnection(http.client.HTTPConnection):
        def __init__(self, host: str, port: int | None, *, timeout: float,
                     read_timeout: float) -> None:
            super().__init__(host, port, timeout=timeout)
            self.read_timeout = read_timeout

        def connect(self) -> None:
            super().connect()
            self.sock.settimeout(self.read_timeout)

    tls: _NewConnection | None = None
    if hasattr(http.client, "HTTPSConnection"):  # Python built with ssl
        class TlsConnection(http.client.HTTPSConnection):
            # the default context: certificates verified against the system CAs
            def __init__(self, host: str, port: int | None, *, timeout: float,
                         read_timeout: float) -> None:
                super().__init__(host, port, timeout=timeout)
                self.read_timeout = read_timeout

            def connect(self) -> None:
                super().connect()  # TCP connect and TLS handshake within self.timeout
                self.sock.settimeout(self.read_timeout)
        tls = TlsConnection
    return UnixConnection, TcpConnection, tls


@dataclass
class Conn:
    socket: str = DEFAULT_SOCKET
    server: str | None = None
    token: str | None = None
    timeout: float = 30.0

    @property
    def where(self) -> str:
        return self.server if self.server else f"unix socket {self.socket}"

    def close(self) -> None:
        """Nothing to do: each request has its own connection (closed after it)."""

    def _connection(self) -> tuple[http.client.HTTPConnection, str]:
        """A new connection to qosd and the path prefix of --server (or "")."""
        unix, tcp, tls = _connection_classes()
        connect_timeout = min(self.timeout, 5.0)
        if not self.server:
            return unix(self.socket, timeout=connect_timeout, read_timeout=self.timeout), ""
        from urllib.parse import urlsplit

        url = self.server if "://" in self.server else f"http://{self.server}"
        try:
            parts = urlsplit(url)
            scheme, host, port = parts.scheme.lower(), parts.hostname, parts.port
        except ValueError as e:  # e.g. a port that is not a number
            fail(EXIT.USAGE, f"error: bad --server URL {self.server!r}: {e}")
        cls = tcp if scheme == "http" else tls if scheme == "https" else None
        if cls is None:
            fail(EXIT.USAGE, f"error: bad --server URL {self.server!r}: "
                             f"unsupported scheme {parts.scheme!r} (http or https)")
        if not host:
            fail(EXIT.USAGE, f"error: bad --server URL {self.server!r}: no host")
        if ":" in host:
            host = f"[{host}]"  # IPv6 literal, as http.client wants it
        try:
            conn = cls(host, port, timeout=connect_timeout, read_timeout=self.timeout)
        except ValueError as e:  # http.client.InvalidURL is one
            fail(EXIT.USAGE, f"error: bad --server URL {self.server!r}: {e}")
        return conn, parts.path.rstrip("/")

    def _send(self, method: str, path: str, json_body: Any,
              params: dict[str, Any] | None) -> Response:
        conn, prefix = self._connection()
        if params:
            from urllib.parse import urlencode

            path = f"{path}?{urlencode(params)}"
        headers = {"User-Agent": f"{PROG}/1", "Accept": "application/json",
                   "Connection": "close"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        body = None
        if json_body is not None:
            body = json.dumps(json_body, ensure_ascii=False).encode("utf-8")
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, prefix + path, body=body, headers=headers)
            r = conn.getresponse()
            return Response(r.status, r.read())
        finally:
            conn.close()

    def request(self, method: str, path: str, *, json_body: Any = None,
                params: dict[str, Any] | None = None) -> Any:
        """The JSON answer of a 2xx; anything else ends the program with its exit code."""
        import http.client

        if not self.server:
            try:
                os.stat(self.socket)
            except (FileNotFoundError, NotADirectoryError):
                fail(EXIT.UNREACHABLE,
                     f"error: no qosd socket at {self.socket} (is qosd running? "
                     "set --socket/MMMESH_SOCKET, or --server for TCP)")
            except OSError:
                pass  # e.g. EACCES on the directory: connect() says it properly
        try:
            r = self._send(method, path, json_body, params)
        except TimeoutError:  # socket.timeout: connecting, the TLS handshake or the answer
            fail(EXIT.UNREACHABLE, f"error: qosd at {self.where} did not answer within "
                                   f"{self.timeout:g}s")
        except OSError as e:  # refused, reset, no such host, TLS errors, ...
            if e.errno in (errno.EACCES, errno.EPERM):
                fail(EXIT.AUTH, f"error: permission denied on {self.where} "
                                "(the socket is root only; use sudo)")
            reason = e.strerror or str(e) or type(e).__name__
            fail(EXIT.UNREACHABLE, f"error: cannot reach qosd at {self.where}: {reason}")
        except http.client.HTTPException as e:  # a broken or cut answer
            fail(EXIT.UNREACHABLE, f"error: cannot reach qosd at {self.where}: "
                                   f"{str(e) or type(e).__name__}")
        if r.is_success:
            try:
                return r.json()
            except ValueError:
                fail(EXIT.OTHER, f"error: qosd sent a non-JSON answer ({r.status_code})")
        _http_error(r)


def _http_error(r: Response) -> NoReturn:
    code = _HTTP_EXIT.get(r.status_code, EXIT.OTHER)
    try:
        body = r.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        fail(code, f"error: qosd answered HTTP {r.status_code}: {r.text[:200].strip()}")
    kind = str(body.get("error", f"http_{r.status_code}"))
    message = str(body.get("message", "")) or kind
    details: list[str] = []
    for item in body.get("errors") or []:
        if isinstance(item, list | tuple) and len(item) == 2:
            loc, msg = item
            details.append(f"{loc}: {msg}" if loc else str(msg))
    if kind == "invalid_policy" and details:
        n = len(details)
        fail(code, f"error: policy rejected: {n} problem{'s' if n != 1 else ''}", details)
    if kind == "unrealizable" and details:
        fail(code, "error: policy rejected: it cannot be applied on this node", details)
    if kind == "invalid_request" and details:
        fail(code, "error: request rejected by qosd", details)
    if kind == "conflict":
        fail(code, f"error: conflict: {message}; re-read it (mmmeshctl policy get) and retry"
                   " with --base-version " + str(body.get("current_version", "N")))
    if kind == "unauthorized":
        fail(code, "error: authentication failed: missing or wrong token (--token / "
                   "MMMESH_TOKEN)")
    if kind == "dataplane":
        fail(code, f"error: the node's dataplane refused the change (last good policy kept): "
                   f"{message}")
    fail(code, f"error: {message}")


def _conn(ctx: typer.Context) -> Conn:
    obj = ctx.find_object(Conn)
    if obj is None:  # pragma: no cover - the callback always sets it
        obj = Conn()
    return obj


def _read_file(path: str) -> str:
    try:
        if path == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as f:
                data = f.read()
    except OSError as e:
        fail(EXIT.USAGE, f"error: cannot read {path}: {e.strerror or e}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        fail(EXIT.REJECTED, f"error: policy rejected: {path} is not UTF-8 text "
                            f"({e.reason} at byte {e.start})")


def _default_author() -> str:
    import getpass
    import socket

    user = os.environ.get("SUDO_USER") or ""
    if not user:
        with contextlib.suppress(Exception):
            user = getpass.getuser()
    return f"{user or 'unknown'}@{socket.gethostname()}"


# --------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------
def _out() -> Console:
    from rich.console import Console

    # Not a terminal (pipes, CI logs): wide enough that tables are not cut.
    width = None if sys.stdout.isatty() else 160
    return Console(highlight=False, soft_wrap=False, width=width)


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _ago(ts: float | None) -> str:
    if ts is None:
        return "-"
    s = max(0.0, time.time() - ts)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{s / 60:.0f}m"
    if s < 86400:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


def human_rate(bps: float) -> str:
    """bit/s as "150.0 Mbit/s" (SI, as tc and the policy count)."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.1f} {unit}"
    return f"{bps:.0f} bit/s"


def human_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, ensure_ascii=False))


def _policy_tables(doc: dict[str, Any]) -> Group:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    pol = doc["policy"]
    link = pol.get("link", {})
    head = Text()
    head.append(f"policy version {doc['version']}", style="bold")
    head.append(f"   created {_when(doc.get('created_at'))}")
    if doc.get("author"):
        head.append(f" by {doc['author']}")
    if doc.get("note"):
        head.append(f" ({doc['note']})")
    head.append(f"\nsha256 {doc.get('sha256', '')[:16]}   link {link.get('device')} at "
                f"{link.get('rate')}   default class {pol.get('default_class')}")
    if pol.get("description"):
        head.append(f"\n{pol['description']}", style="dim")
    classes = Table(title=None, box=None, header_style="bold", pad_edge=False)
    for col in ("NAME", "ID", "MATCH", "RATE", "CEIL", "WEIGHT", "PRIO", "DSCP"):
        classes.add_column(col, justify="right" if col in ("ID", "WEIGHT", "PRIO", "DSCP")
                           else "left", overflow="fold")
    for c in pol.get("classes", []):
        match = c.get("match")
        if match:
            what = ",".join(match.get("modalities", []))
            for meta in ("fps", "bitrate", "density"):
                rng = match.get(meta)
                if rng:
                    what += f" {meta}={rng.get('min')}..{rng.get('max')}"
        else:
            what = "(by id only)"
        classes.add_row(
            str(c.get("name")), str(c.get("id")), what, str(c.get("rate")),
            str(c["ceil"]) if c.get("ceil") is not None else "link",
            str(c.get("weight")), str(c.get("priority")),
            str(c["dscp"]) if c.get("dscp") is not None else "-",
        )
    parts: list[Any] = [head, Text(""), classes]
    rules = pol.get("source_rules") or []
    if rules:
        rt = Table(box=None, header_style="bold", pad_edge=False)
        rt.add_column("SOURCE PREFIX")
        rt.add_column("MAX CLASS")
        for r in rules:
            rt.add_row(str(r.get("prefix")), str(r.get("max_class")))
        parts += [Text(""), rt]
    return Group(*parts)


def _flows_table(flows: list[dict[str, Any]], where: str) -> Table:
    from rich.table import Table

    t = Table(title=f"top flows on {where}  ({time.strftime('%H:%M:%S')})", box=None,
              header_style="bold", pad_edge=False, title_justify="left")
    for col, just in (("SOURCE", "left"), ("DESTINATION", "left"), ("PROTO", "left"),
                      ("CLASS", "left"), ("MODALITY", "left"), ("RATE", "right"),
                      ("BYTES", "right"), ("PACKETS", "right"), ("IDLE", "right")):
        t.add_column(col, justify=just, no_wrap=True)  # type: ignore[arg-type]
    for f in flows:
        cls = f.get("class_name") or (f"#{f.get('class_id')}" if f.get("class_id") else "-")
        t.add_row(
            f"{f.get('src')}:{f.get('sport')}", f"{f.get('dst')}:{f.get('dport')}",
            str(f.get("proto")), cls, str(f.get("modality") or "-"),
            human_rate(float(f.get("rate_bps") or 0.0)), human_bytes(float(f.get("bytes") or 0)),
            str(f.get("packets")), f"{float(f.get('idle_s') or 0.0):.1f}s",
        )
    if not flows:
        t.caption = "no flows"
    return t


# --------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------
app = typer.Typer(
    name=PROG,
    help=(
        "Operate mmmesh SLA policies and look at a node's dataplane through qosd.\n\n"
        "Talks to qosd on its unix socket (root), or over TCP with --server and --token.\n\n"
        "Exit codes: 0 ok, 1 other error, 2 usage, 3 policy rejected, 4 conflict, "
        "5 qosd unreachable, 6 not found, 7 authentication failed."
    ),
    epilog=(
        "[bold]Examples[/bold]\n\n"
        "  mmmeshctl policy apply -f policy.yaml\n\n"
        "  mmmeshctl policy get -o yaml\n\n"
        "  mmmeshctl policy history; mmmeshctl policy rollback --to 3\n\n"
        "  mmmeshctl flows top -n 10\n\n"
        "  MMMESH_TOKEN=... mmmeshctl --server http://node1:8470 status"
    ),
    no_args_is_help=True,
    cls=_FastGroup,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
policy_app = typer.Typer(
    help="Validate, apply, diff, inspect and roll back SLA policies.",
    no_args_is_help=True, cls=_FastGroup,
)
flows_app = typer.Typer(help="The flows the dataplane sees.", no_args_is_help=True,
                        cls=_FastGroup)
app.add_typer(policy_app, name="policy")
app.add_typer(flows_app, name="flows")

FileOpt = Annotated[str, typer.Option("--filename", "-f", metavar="FILE",
                                      help="policy YAML file ('-' = stdin)")]
BaseOpt = Annotated[int | None, typer.Option(
    "--base-version", min=0, metavar="N",
    help="refuse (exit 4) unless the current version is still N (0 = none yet)")]


@app.callback()
def _global(
    ctx: typer.Context,
    socket_path: Annotated[str, typer.Option(
        "--socket", envvar="MMMESH_SOCKET", metavar="PATH",
        help="qosd's unix socket")] = DEFAULT_SOCKET,
    server: Annotated[str | None, typer.Option(
        "--server", envvar="MMMESH_SERVER", metavar="URL",
        help="qosd over TCP instead, e.g. http://node1:8470")] = None,
    token: Annotated[str | None, typer.Option(
        "--token", envvar="MMMESH_TOKEN", metavar="TOKEN",
        help="bearer token for --server", show_default=False)] = None,
    timeout: Annotated[float, typer.Option(
        "--timeout", min=0.1, envvar="MMMESH_TIMEOUT", metavar="SECONDS",
        help="give up on qosd after this long")] = 30.0,
) -> None:
    conn = Conn(socket=socket_path, server=server or None, token=token or None, timeout=timeout)
    ctx.obj = conn
    ctx.call_on_close(conn.close)


# -- policy -----------------------------------------------------------------
@policy_app.command(cls=_FastCommand, name="apply")
def policy_apply(
    ctx: typer.Context,
    filename: FileOpt,
    base_version: BaseOpt = None,
    author: Annotated[str | None, typer.Option(
        "--author", help="recorded with the version \\[default: user@host]")] = None,
) -> None:
    """Apply a policy file as a new version (validated whole, then reconciled).

    [bold]Examples[/bold]

      mmmeshctl policy apply -f examples/policy.yaml

      mmmeshctl policy apply -f edited.yaml --base-version 3   [dim]# exit 4 if someone was faster[/dim]
    """
    text = _read_file(filename)
    body = {"yaml": text, "base_version": base_version, "author": author or _default_author()}
    res = _conn(ctx).request("PUT", "/v1/policy", json_body=body)
    rec = res.get("reconcile") or {}
    typer.echo(f"policy applied: version {res['version']} "
               f"(reconciled in {float(rec.get('duration_s', 0.0)) * 1000:.0f} ms)")
    if rec and not rec.get("ok", True):
        fail(EXIT.OTHER, f"warning: reconcile reported a problem: {rec.get('error')}")


@policy_app.command(cls=_FastCommand, name="get")
def policy_get(
    ctx: typer.Context,
    output: Annotated[Output, typer.Option("--output", "-o", help="output format")] =
    Output.table,
    version: Annotated[int | None, typer.Option(
        "--version", min=1, metavar="N", help="a stored version instead of the current")] = None,
) -> None:
    """Show the current policy (or a stored --version).

    [bold]Examples[/bold]

      mmmeshctl policy get

      mmmeshctl policy get -o yaml > policy.yaml   [dim]# edit, then apply -f[/dim]

      mmmeshctl policy get --version 2 -o json
    """
    path = "/v1/policy" if version is None else f"/v1/policy/versions/{version}"
    doc = _conn(ctx).request("GET", path)
    if output is Output.json:
        _json(doc)
    elif output is Output.yaml:
        typer.echo(f"# policy version {doc['version']}, sha256 {doc['sha256'][:16]}", nl=True)
        typer.echo(doc["yaml"], nl=False)
    else:
        _out().print(_policy_tables(doc))


@policy_app.command(cls=_FastCommand, name="diff")
def policy_diff(ctx: typer.Context, filename: FileOpt) -> None:
    """Show what applying a file would change (unified diff of the canonical YAML).

    [bold]Example[/bold]

      mmmeshctl policy diff -f edited.yaml
    """
    text = _read_file(filename)
    res = _conn(ctx).request("POST", "/v1/policy/diff", json_body={"yaml": text})
    if not res.get("changed"):
        typer.echo("no changes", err=True)
        return
    from rich.text import Text

    out = _out()
    for line in str(res["diff"]).splitlines():
        style = ("bold" if line.startswith(("---", "+++")) else
                 "green" if line.startswith("+") else
                 "red" if line.startswith("-") else
                 "cyan" if line.startswith("@@") else "")
        out.print(Text(line, style=style))


@policy_app.command(cls=_FastCommand, name="validate")
def policy_validate(
    ctx: typer.Context,
    filename: FileOpt,
    local: Annotated[bool, typer.Option(
        "--local", help="check the schema here, without qosd (not whether the node can "
                        "realise it)")] = False,
) -> None:
    """Check a policy file without applying it (exit 3 with every problem when invalid).

    [bold]Examples[/bold]

      mmmeshctl policy validate -f policy.yaml

      mmmeshctl policy validate --local -f policy.yaml   [dim]# no daemon needed[/dim]
    """
    text = _read_file(filename)
    if local:
        from ._errors import PolicyError
        from .policy import parse_policy

        try:
            pol = parse_policy(text, source=filename)
        except PolicyError as e:
            n = len(e.errors)
            fail(EXIT.REJECTED, f"error: policy rejected: {n} problem{'s' if n != 1 else ''}",
                 [f"{loc}: {msg}" if loc else msg for loc, msg in e.errors])
        summary = {"classes": [c.name for c in pol.classes], "link": pol.link.device,
                   "rate": str(pol.link.rate)}
    else:
        res = _conn(ctx).request("POST", "/v1/policy/validate", json_body={"yaml": text})
        p = res["policy"]
        summary = {"classes": [c["name"] for c in p["classes"]], "link": p["link"]["device"],
                   "rate": str(p["link"]["rate"])}
    typer.echo(f"{filename}: valid: {len(summary['classes'])} classes "
               f"({', '.join(summary['classes'])}) on {summary['link']} at {summary['rate']}")


@policy_app.command(cls=_FastCommand, name="history")
def policy_history(
    ctx: typer.Context,
    output: Annotated[ListOutput, typer.Option("--output", "-o")] = ListOutput.table,
) -> None:
    """List the stored policy versions, newest first (* = current).

    [bold]Example[/bold]

      mmmeshctl policy history
    """
    conn = _conn(ctx)
    res = conn.request("GET", "/v1/policy/history")
    if output is ListOutput.json:
        _json(res)
        return
    current = conn.request("GET", "/v1/status").get("policy_version")
    from rich.table import Table

    t = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("VERSION", "CREATED", "AUTHOR", "NOTE", "SHA256"):
        t.add_column(col, justify="right" if col == "VERSION" else "left")
    for v in res.get("versions", []):
        mark = "*" if v["version"] == current else " "
        t.add_row(f"{mark}{v['version']}", _when(v.get("created_at")), v.get("author") or "-",
                  v.get("note") or "-", str(v.get("sha256", ""))[:12])
    if not res.get("versions"):
        typer.echo("no policy versions yet", err=True)
        return
    _out().print(t)


@policy_app.command(cls=_FastCommand, name="rollback")
def policy_rollback(
    ctx: typer.Context,
    to: Annotated[int, typer.Option("--to", min=1, metavar="VERSION",
                                    help="the version whose policy to apply again")],
    base_version: BaseOpt = None,
    author: Annotated[str | None, typer.Option("--author")] = None,
) -> None:
    """Apply an earlier version's policy again, as a new version.

    [bold]Examples[/bold]

      mmmeshctl policy history

      mmmeshctl policy rollback --to 3

      mmmeshctl policy rollback --to 3 --base-version 5
    """
    body = {"to_version": to, "base_version": base_version,
            "author": author or _default_author()}
    res = _conn(ctx).request("POST", "/v1/policy/rollback", json_body=body)
    typer.echo(f"rolled back to version {to}: now version {res['version']}")


# -- status -------------------------------------------------------------------
@app.command(cls=_FastCommand, name="status")
def status(
    ctx: typer.Context,
    output: Annotated[ListOutput, typer.Option("--output", "-o")] = ListOutput.table,
) -> None:
    """The node: policy version, last reconcile, uplinks, store problems.

    [bold]Examples[/bold]

      mmmeshctl status

      mmmeshctl --server http://node1:8470 --token $TOKEN status -o json
    """
    st = _conn(ctx).request("GET", "/v1/status")
    if output is ListOutput.json:
        _json(st)
        return
    from rich.table import Table
    from rich.text import Text

    t = Table(box=None, show_header=False, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    t.add_row("node", str(st.get("node")))
    t.add_row("policy version", str(st.get("policy_version") or "none"))
    t.add_row("up since", f"{_when(st.get('started_at'))} ({_ago(st.get('started_at'))})")
    t.add_row("adopted dataplane", "yes" if st.get("adopted") else "no")
    rec = st.get("last_reconcile")
    if rec:
        state = "ok" if rec.get("ok") else f"FAILED: {rec.get('error')}"
        line = (f"{state}, {rec.get('trigger')} of version {rec.get('version')}, "
                f"{_ago(rec.get('started_at'))} ago, {float(rec.get('duration_s', 0)) * 1000:.0f}"
                " ms")
        if rec.get("repaired"):
            line += f", repaired: {', '.join(rec['repaired'])}"
        t.add_row("last reconcile", Text(line, style="" if rec.get("ok") else "red"))
    else:
        t.add_row("last reconcile", "-")
    for dev, info in (st.get("uplinks") or {}).items():
        if not isinstance(info, dict):
            t.add_row(f"uplink {dev}", str(info))
            continue
        if "error" in info:
            t.add_row(f"uplink {dev}", Text(f"error: {info['error']}", style="red"))
            continue
        bits = [f"{'loaded' if info.get('loaded') else 'NOT loaded'}"]
        for key in ("policy_version", "abi_version", "flows"):
            if key in info:
                bits.append(f"{key.replace('_', ' ')} {info[key]}")
        t.add_row(f"uplink {dev}", ", ".join(bits))
    problems = st.get("store_problems") or []
    t.add_row("store problems", Text("\n".join(problems), style="yellow") if problems else "none")
    out = _out()
    out.print(t)
    for dev, info in (st.get("uplinks") or {}).items():
        if isinstance(info, dict) and info.get("loaded"):
            out.print(_uplink_table(dev, info))
    sla = st.get("sla") or {}
    if isinstance(sla, dict) and sla.get("stages"):
        out.print(_sla_table(sla["stages"], "SLA attainment per stage (last window of each "
                                            "sidecar, replicas merged)", per_stage=True))
        out.print(_sla_table(sla.get("classes") or [], "SLA per class, node-wide (every "
                                                       "stage merged)", per_stage=False))


def _sla_table(rows: list[dict[str, Any]], title: str, *, per_stage: bool) -> Any:
    """Merged SLA rows (api.SlaMerged): one per stage and class, or per class."""
    from rich.table import Table
    from rich.text import Text

    t = Table(title=title, title_justify="left", box=None, header_style="bold", pad_edge=False)
    cols = (("STAGE",) if per_stage else ()) + (
        "CLASS", "MODALITY", "SIDECARS" if per_stage else "WINDOWS", "FRAMES", "IN DEADLINE",
        "MISSES", "DROPS", "ERRORS", "E2E P50", "E2E P99", "AGE")
    for col in cols:
        t.add_column(col, justify="left" if col in ("STAGE", "CLASS", "MODALITY") else "right")
    for r in rows:
        e2e = r.get("e2e_ms") or {}
        att = float(r.get("attainment", 1.0))
        cells = ([str(r.get("stage"))] if per_stage else []) + [
            str(r.get("sla_class")), str(r.get("modality")), str(r.get("sources")),
            str(r.get("frames")), Text(f"{att * 100:.1f}%", style="" if att >= 0.99 else "red"),
            str(r.get("deadline_misses")), str(r.get("drops")), str(r.get("errors")),
            f"{e2e['p50']:.1f} ms" if e2e else "-",
            f"{e2e['p99']:.1f} ms" if e2e else "-", _ago(r.get("received_at"))]
        t.add_row(*cells)
    return t


def _uplink_table(dev: str, info: dict[str, Any]) -> Any:
    """Programs, then one row per class: BPF counters and HTB statistics."""
    from rich.table import Table

    progs = ", ".join(f"{d} prog {p.get('prog_id')}" for d, p in
                      sorted((info.get("programs") or {}).items())) or "NO programs attached"
    t = Table(title=f"{dev}: {progs}", title_justify="left", box=None, header_style="bold",
              pad_edge=False)
    for col in ("CLASS", "HTB", "RANK", "EGRESS PKTS", "EGRESS BYTES", "INGRESS PKTS",
                "HTB PKTS", "DROPS", "OVERLIMITS", "BACKLOG"):
        t.add_column(col, justify="left" if col in ("CLASS", "HTB") else "right")
    for name, c in (info.get("classes") or {}).items():
        h = c.get("htb") or {}
        t.add_row(name, str(c.get("classid")), str(c.get("rank")),
                  str(c.get("egress_packets", 0)), _size(c.get("egress_bytes", 0)),
                  str(c.get("ingress_packets", 0)), str(h.get("packets", "-")),
                  str(h.get("drops", "-")), str(h.get("overlimits", "-")),
                  _size(h.get("backlog", 0)))
    reasons = info.get("reasons") or {}
    eg = reasons.get("egress") or {}
    if eg:
        t.caption = "egress reasons: " + "  ".join(f"{k}={v}" for k, v in eg.items())
        t.caption_justify = "left"
    return t


def _size(n: Any) -> str:
    try:
        v = float(n)
    except (TypeError, ValueError):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if v < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return str(n)


# -- flows --------------------------------------------------------------------
@flows_app.command(cls=_FastCommand, name="top")
def flows_top(
    ctx: typer.Context,
    n: Annotated[int, typer.Option("-n", "--count", min=1, max=1000,
                                   help="how many flows")] = 20,
    watch: Annotated[bool, typer.Option("--watch/--once",
                                        help="refresh until Ctrl-C, or print once")] = True,
    interval: Annotated[float, typer.Option("--interval", min=0.1, metavar="SECONDS",
                                            help="refresh period")] = 1.0,
    output: Annotated[ListOutput, typer.Option("--output", "-o",
                                               help="json implies --once")] = ListOutput.table,
) -> None:
    """The busiest flows with their class and rate (live; --once for one table).

    [bold]Examples[/bold]

      mmmeshctl flows top

      mmmeshctl flows top -n 5 --once
    """
    conn = _conn(ctx)

    def fetch() -> list[dict[str, Any]]:
        return list(conn.request("GET", "/v1/flows/top", params={"n": n}).get("flows", []))

    if output is ListOutput.json:
        _json({"flows": fetch()})
        return
    where = conn.server or "this node"
    if not watch:
        _out().print(_flows_table(fetch(), where))
        return
    from rich.live import Live

    # qosd estimates rates between two samples: the first table shows 0
    with contextlib.suppress(KeyboardInterrupt), \
            Live(_flows_table(fetch(), where), console=_out(), auto_refresh=False,
                 screen=False) as live:
        for _ in _ticks(interval):
            live.update(_flows_table(fetch(), where), refresh=True)


def _ticks(interval: float) -> Iterator[None]:
    while True:
        time.sleep(interval)
        yield None


def main() -> None:
    """Console entry point (``mmmeshctl``)."""
    try:
        app(prog_name=PROG)
    except KeyboardInterrupt:
        _err("interrupted")
        raise SystemExit(130) from None
    except BrokenPipeError:  # mmmeshctl ... | head
        with contextlib.suppress(OSError):
            sys.stdout.close()
        raise SystemExit(0) from None


if __name__ == "__main__":
    main()
