"""Tenants of ``tierkv server``: who may use it, under which name, with how many bytes (docs/tenants.md).

A tokens file (YAML, ``tierkv server --tokens-file PATH``) lists the tenants::

    tenants:
      - name: team-a           # [A-Za-z0-9_.-], 1..64 chars, unique
        token: "long random"   # unique; what the tenant's clients set as l3.zmq.token
        quota_bytes: 8GiB      # > 0: an integer or a size with a unit (KiB/MiB/GiB = 1024-based, KB/MB/GB 1000)
        evict: true            # optional (default: the server's --no-evict unset = true): over quota, evict own LRU
        admin: false           # optional: its stats also show every other tenant's counters

:func:`load_tokens_file` raises :class:`TokensFileError` naming the file and line of the first problem (unreadable
file, not YAML, unknown key, duplicate token or name, negative or unparsable quota). Tokens are never kept in clear
in the table: a request's token is looked up by its SHA-256 (:meth:`TenantTable.by_token`).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Optional

import yaml

from tierkv.storage_backends.common import parse_bytes

#: the tenant of single-token and no-token servers (and the one whose pages spill to the spill directory's root)
DEFAULT_TENANT = "default"
TENANT_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_KEYS = ("name", "token", "quota_bytes", "evict", "admin")


class TokensFileError(ValueError):
    """A tokens file that cannot be used; the message names the file and the line."""


@dataclass(frozen=True)
class Tenant:
    """One tenant: ``name``, ``quota_bytes`` (bound on its stored bytes in memory: page headers + payloads),
    ``evict`` (over quota: evict its own least-recently-used pages; False: refuse the write), ``admin`` (sees every
    tenant's counters in ``stats``)."""

    name: str
    quota_bytes: int
    evict: bool = True
    admin: bool = False


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TenantTable:
    """Tenants by token digest. ``tokens`` (the clear tokens) are kept only for redacting them from log lines."""

    def __init__(self, entries: list[tuple[Optional[str], Tenant]], from_file: bool):
        self.from_file = from_file
        self.tenants = {t.name: t for _tok, t in entries}
        self._by_digest = {token_digest(tok): t for tok, t in entries if tok}
        self.tokens = [tok for tok, _t in entries if tok]
        self.open = not self._by_digest  # no token at all: every request is the one tenant's

    def by_token(self, token: object) -> Optional[Tenant]:
        """The tenant whose token this is (None: unknown, missing, or not a string)."""
        if self.open:
            return next(iter(self.tenants.values()))
        if not isinstance(token, str):
            return None
        return self._by_digest.get(token_digest(token))


def single_tenant(token: Optional[str], capacity_bytes: int, evict: bool = True) -> TenantTable:
    """The table of a server started with one token (or none): one admin tenant, :data:`DEFAULT_TENANT`, whose quota
    is the whole capacity."""
    return TenantTable([(token or None, Tenant(DEFAULT_TENANT, int(capacity_bytes), evict, True))], from_file=False)


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def load_tokens_file(path: str, default_evict: bool = True) -> TenantTable:
    """Parse the tokens file at ``path`` (format: the module docstring). Raises :class:`TokensFileError`."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise TokensFileError(f"tokens file {path}: cannot read it: {getattr(e, 'strerror', None) or e}") from None
    where = f"tokens file {path}"
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" line {mark.line + 1}" if mark is not None else ""
        raise TokensFileError(f"{where}{at}: not valid YAML ({getattr(e, 'problem', None) or 'parse error'})") from None
    if not isinstance(root, yaml.MappingNode):
        raise TokensFileError(f"{where} line {_line(root) if root else 1}: expected a mapping with key 'tenants'")
    top = {k.value: v for k, v in root.value}
    if set(top) != {"tenants"} or not isinstance(top["tenants"], yaml.SequenceNode):
        raise TokensFileError(f"{where} line {_line(root)}: the only top-level key is 'tenants', a list of tenants")
    entries: list[tuple[str, Tenant]] = []
    seen_tok: dict[str, int] = {}
    seen_name: dict[str, int] = {}
    for item in top["tenants"].value:
        at = f"{where} line {_line(item)}"
        if not isinstance(item, yaml.MappingNode):
            raise TokensFileError(f"{at}: each tenant is a mapping with keys {', '.join(_KEYS)}")
        fields: dict = {}
        for k, v in item.value:
            if k.value not in _KEYS:
                raise TokensFileError(f"{where} line {_line(k)}: unknown key {str(k.value)[:40]!r}; allowed keys are "
                                      f"{', '.join(_KEYS)}")
            if not isinstance(v, yaml.ScalarNode):
                raise TokensFileError(f"{where} line {_line(v)}: {k.value!r} must be a single value")
            fields[k.value] = v
        for need in ("name", "token", "quota_bytes"):
            if need not in fields:
                raise TokensFileError(f"{at}: missing key {need!r}")
        name, token = fields["name"].value, fields["token"].value
        if not TENANT_NAME_RE.match(name):
            raise TokensFileError(f"{where} line {_line(fields['name'])}: tenant name {name[:70]!r} must be 1-64 of "
                                  "A-Z a-z 0-9 _ . -")
        if not token.strip():
            raise TokensFileError(f"{where} line {_line(fields['token'])}: empty token for tenant {name!r}")
        if name in seen_name:
            raise TokensFileError(f"{where} line {_line(fields['name'])}: duplicate tenant name {name!r} (first on "
                                  f"line {seen_name[name]})")
        if token in seen_tok:  # the token itself is never printed
            raise TokensFileError(f"{where} line {_line(fields['token'])}: duplicate token (tenant {name!r}; the same "
                                  f"token is on line {seen_tok[token]})")
        seen_name[name], seen_tok[token] = _line(fields["name"]), _line(fields["token"])
        q = fields["quota_bytes"]
        try:
            quota = parse_bytes(q.value)
        except (ValueError, TypeError):
            quota = None
        if quota is None or quota <= 0:
            raise TokensFileError(f"{where} line {_line(q)}: quota_bytes {q.value[:40]!r} of tenant {name!r} must be a "
                                  "byte size > 0 (e.g. 1073741824, 512MiB, 8GiB, 10GB)")
        flags = {}
        for k, dflt in (("evict", default_evict), ("admin", False)):
            v = fields.get(k)
            val = dflt if v is None else {"true": True, "false": False}.get(v.value.lower())
            if val is None:
                raise TokensFileError(f"{where} line {_line(v)}: {k} must be true or false, got {v.value[:40]!r}")
            flags[k] = val
        entries.append((token, Tenant(name, quota, flags["evict"], flags["admin"])))
    if not entries:
        raise TokensFileError(f"{where} line {_line(root)}: no tenants listed")
    return TenantTable(entries, from_file=True)
