"""Page keys: chained, deterministic content hashes of pages, seeded by a namespace.

``key(page_i) = BLAKE2b-128[salt = key(page_{i-1}), person = encoding tag](tokens of page_i [|| 0x01 || extra key])``
with ``key(page_-1)`` = the request root, a hash of the model namespace, the LoRA adapter and the cache salt. So a
key names the whole prefix up to its page and everything that changes the page's bytes (model, dtype, layout, page
size, geometry, parallel rank). Tokens are little-endian uint32 when every token of the page fits (person tag
``tierkv/pk2/u32``), else int64 (``tierkv/pk2/i64``), decided per page. BLAKE2b is cryptographic: no tenant can make
two prefixes collide. The parent key rides in BLAKE2b's salt, so a page of up to 32 tokens is one compression.

Speed: one compiled loop (numba, when it imports) hashes the pages of a call; :func:`page_keys_reference` is the same
derivation through :mod:`hashlib` (short calls, extra keys, big-endian hosts, no numba), and the tests check both
agree. Keys are pure functions of their inputs (no Python ``hash``, pickle or per-process seed); structured values
are canonical msgpack with ``None``, empty tuple and absent kept distinct. A key is 16 bytes; L3 stores index by
its ``.hex()`` (32 lowercase hex chars).
"""
from __future__ import annotations

import hashlib
import os
import struct
import sys
from array import array
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional, Sequence

import msgpack

KEY_BYTES = 16
KEY_HEX_LEN = 2 * KEY_BYTES
#: bumped whenever the byte format of pages or keys changes; part of every namespace.
FORMAT_VERSION = 2  # 2: BLAKE2b with the parent key as salt, uint32 tokens
_DOMAIN = b"tierkv/page-key/v1"


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for p in parts:
        h.update(p)
    return h.digest()


def _canonical(value: Any) -> bytes:
    """Canonical msgpack of plain values (str, bytes, int, float, bool, None, lists/tuples, dicts with
    sortable keys). Raises TypeError for anything else (never falls back to repr or pickle)."""

    def norm(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return [[norm(k), norm(v[k])] for k in sorted(v)]
        if v is None or isinstance(v, (str, bytes, int, float, bool)):
            return v
        raise TypeError(f"cannot hash value of type {type(v).__name__} into a page key")

    return msgpack.packb(norm(value), use_bin_type=True)


@dataclass(frozen=True)
class ModelNamespace:
    """Everything that changes the bytes of a page, shared by all requests of one engine rank.

    Fields: ``model_id`` (path or name, plus revision if any), ``dtype`` (KV element type as stored, e.g.
    ``"bfloat16"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``: FP8 caches are ``uint8`` tensors in vLLM, so the cache dtype's
    name is used), ``kv_layout`` (the byte layout pages are stored in: the host-pool layout plus the device pool's
    packing, e.g. ``"layer_first/cpu-amx/LBHNC"``, ``"layer_first/flash/LBNHC"``), ``page_size`` (tokens),
    ``num_layers``, ``num_kv_heads`` (on this rank), ``head_dim``, ``tp_rank``/``tp_size``, ``pp_rank``/``pp_size``,
    ``use_mla`` (MLA pages are identical across TP ranks, so ``tp_rank`` is ignored for them) and ``extra``
    (further facts that change the bytes, as ``(name, value)`` pairs; the vLLM connector puts the model's dtype,
    its weight quantisation and the host byte order there).
    """

    model_id: str
    dtype: str
    kv_layout: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    use_mla: bool = False
    extra: tuple = field(default_factory=tuple)
    #: the operator's ``namespace_salt`` (docs/tenants.md): in :meth:`digest` (so in every page key and L3 key), never
    #: in ``repr`` or :meth:`describe` (the description is written into shared stores); None = no salt
    salt: Optional[str] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be > 0 tokens, got {self.page_size}")

    def digest(self) -> bytes:
        """16-byte digest of the namespace (stable across processes, Python versions and machines). Without a salt
        it is what it was before salts existed."""
        d = asdict(self)
        salt = d.pop("salt")
        if self.use_mla:
            d["tp_rank"] = 0  # one copy of MLA pages serves every rank
        d["format_version"] = FORMAT_VERSION
        if salt:
            d["namespace_salt"] = salt
        return _h(_DOMAIN, b"ns", _canonical(d))

    def describe(self) -> dict:
        """The fields for an operator (``tierkv store stats``): everything but the salt, which is only said to be set
        (``namespace_salt: "set"``): a description that gave it away would let anyone who reads the store compute
        this deployment's keys."""
        d = asdict(self)
        if d.pop("salt"):
            d["namespace_salt"] = "set"
        return d


#: environment variable holding the operator's namespace salt (for containers; same meaning as ``namespace_salt``)
NAMESPACE_SALT_ENV = "TIERKV_NAMESPACE_SALT"
#: longest namespace salt accepted (characters)
MAX_SALT_CHARS = 1024


def check_salt(v: Any, what: str = "namespace_salt") -> Optional[str]:
    """A namespace salt: None/absent, or a string of 1..:data:`MAX_SALT_CHARS` printable characters without leading or
    trailing blanks (a stray newline from a secret file would silently give another salt). Raises ValueError naming
    ``what`` and what is allowed; the value itself is never quoted."""
    if v is None:
        return None
    if not isinstance(v, str) or not v or len(v) > MAX_SALT_CHARS or v != v.strip() or not v.isprintable():
        got = f"{len(v)} characters" if isinstance(v, str) else f"a {type(v).__name__}"
        raise ValueError(f"{what} must be a string of 1-{MAX_SALT_CHARS} printable characters without leading or "
                         f"trailing blanks, or null for no salt (got {got})")
    return v


def resolve_salt(configured: Optional[str], env: Optional[dict] = None) -> Optional[str]:
    """The salt in force: ``namespace_salt`` from the config or ``$TIERKV_NAMESPACE_SALT`` (an empty variable is
    unset). Raises ValueError when both are set and differ (which one the operator meant is unknown) or the variable
    is not a valid salt."""
    raw = (os.environ if env is None else env).get(NAMESPACE_SALT_ENV) or None
    from_env = check_salt(raw, f"${NAMESPACE_SALT_ENV}")
    if configured and from_env and configured != from_env:
        raise ValueError(f"namespace_salt and ${NAMESPACE_SALT_ENV} are both set and differ: set one of them")
    return configured or from_env


def adapter_digest(path: str) -> str:
    """Content digest of a LoRA adapter: xxh3-128 (hex) over every regular file under ``path`` (or the file
    ``path``), in sorted relative-path order, each as its relative path, its size and its bytes; names starting with
    ``.`` are skipped (VCS and cache folders). So the weights (``*.safetensors``/``*.bin``) and ``adapter_config.json``
    (rank, alpha, target modules: they change the outputs too) are in it. Reads every byte once.
    Raises OSError when ``path`` does not exist or holds no file."""
    import xxhash

    root = os.path.abspath(path)
    if os.path.isfile(root):
        files = [(os.path.basename(root), root)]
    else:
        files = []
        for d, dirs, names in os.walk(root):
            dirs[:] = [x for x in dirs if not x.startswith(".")]
            files += [(os.path.relpath(os.path.join(d, n), root), os.path.join(d, n)) for n in names
                      if not n.startswith(".") and os.path.isfile(os.path.join(d, n))]
    if not files:
        raise OSError(f"no adapter files under {path!r}")
    h = xxhash.xxh3_128()
    for rel, full in sorted(files):
        rb = rel.replace(os.sep, "/").encode()
        h.update(struct.pack("<Q", len(rb)) + rb + struct.pack("<Q", os.path.getsize(full)))
        with open(full, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


_LORA_IDS: dict = {}


def lora_identity(name: Optional[str], path: Optional[str], adapter_id: Any = None) -> Optional[str]:
    """What a LoRA request puts into its key chain (:func:`request_root`'s ``lora``): ``"<name>@xxh3:<digest>"``
    with :func:`adapter_digest` of the adapter's files, so a changed adapter under the same name never meets pages
    of the old one and two adapters never share pages. None for no adapter (an empty name is none).

    The digest is computed once per (name, path, ``adapter_id``) in a process (the engine loads an adapter's weights
    once per id) and cached. Raises OSError when the files cannot be read (the caller decides what to do)."""
    if not name:
        return None
    k = (name, path, adapter_id)
    ident = _LORA_IDS.get(k)
    if ident is None:
        ident = _LORA_IDS[k] = f"{name}@xxh3:{adapter_digest(path or '')}"
    return ident


def request_root(namespace_digest: bytes, lora: Optional[str] = None, cache_salt: Optional[str] = None) -> bytes:
    """Root of one request's key chain (16 bytes).

    ``lora`` is the LoRA adapter's identity (:func:`lora_identity`: name and content digest; ``None`` = base model);
    ``cache_salt`` is vLLM's per-request salt.
    An empty salt is the same as no salt (both mean "shared with every unsalted request"); an empty LoRA name
    is the same as no LoRA.
    """
    return _h(_DOMAIN, b"root", namespace_digest, _canonical([lora or None, cache_salt or None]))


_PERSON_U32 = b"tierkv/pk2/u32\x00\x00"
_PERSON_I64 = b"tierkv/pk2/i64\x00\x00"
#: calls with fewer pages than this use hashlib (the compiled loop's call overhead is larger than the work)
KERNEL_MIN_PAGES = 4


def _page_message(tokens: Sequence[int], ek: Any) -> tuple[bytes, bytes]:
    """(message, person tag) of one page: uint32-LE tokens if all fit, else int64-LE; then the extra key."""
    n = len(tokens)
    try:
        msg, person = struct.pack(f"<{n}I", *tokens), _PERSON_U32
    except struct.error:
        msg, person = struct.pack(f"<{n}q", *tokens), _PERSON_I64  # raises struct.error beyond int64
    if ek is not None:
        msg += b"\x01" + _canonical(ek)
    return msg, person


def page_keys_reference(root: bytes, token_ids: Sequence[int], page_size: int,
                        extra_keys: Optional[Sequence[Any]] = None, parent: Optional[bytes] = None,
                        start_page: int = 0) -> list[bytes]:
    """:func:`page_keys` through :mod:`hashlib`, one page at a time (the reference the compiled loop must equal)."""
    n_pages = len(token_ids) // page_size
    if start_page > 0 and parent is None:
        raise ValueError("resuming a key chain needs the parent key")
    prev = parent if parent is not None else root
    out = []
    for i in range(start_page, n_pages):
        ek = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
        msg, person = _page_message(token_ids[i * page_size:(i + 1) * page_size], ek)
        prev = hashlib.blake2b(msg, digest_size=KEY_BYTES, salt=prev, person=person).digest()
        out.append(prev)
    return out


def page_keys(
    root: bytes,
    token_ids: Sequence[int],
    page_size: int,
    extra_keys: Optional[Sequence[Any]] = None,
    parent: Optional[bytes] = None,
    start_page: int = 0,
) -> list[bytes]:
    """Keys of the full pages of ``token_ids`` (a tail shorter than ``page_size`` gets no key).

    Args:
        root: the chain root from :func:`request_root` (16 bytes).
        token_ids: token ids of the whole sequence (ints in int64 range; any sequence of ints).
        page_size: tokens per page.
        extra_keys: optional per-page extra keys (e.g. multimodal hashes), one entry per page or ``None``;
            ``None``, ``()`` and a missing entry are distinct from any non-empty value, and ``None`` == missing.
        parent: key of page ``start_page - 1`` when resuming a chain (``None`` = start at ``root``).
        start_page: index of the first page to hash.
    Returns:
        list of 16-byte keys for pages ``start_page .. len(token_ids) // page_size - 1``.
    Raises:
        ValueError: ``start_page > 0`` without ``parent``. struct.error: a token outside the int64 range.
    Cost: one BLAKE2b compression per page of up to 32 tokens (uint32), plus converting the Python ints once
    (throughput: benchmarks/README.md, section index).
    """
    n_pages = len(token_ids) // page_size
    if start_page > 0 and parent is None:
        raise ValueError("resuming a key chain needs the parent key")
    n = n_pages - start_page
    if n <= 0:
        return []
    if (n < KERNEL_MIN_PAGES or (extra_keys is not None and any(e is not None for e in extra_keys[start_page:]))
            or _kernel() is None):
        return page_keys_reference(root, token_ids, page_size, extra_keys, parent, start_page)
    lo, hi = start_page * page_size, n_pages * page_size
    if isinstance(token_ids, (array, _np().ndarray)):  # already machine integers: converted in C
        a = _np().asarray(token_ids[lo:hi])
        if a.dtype.kind not in "iu" or (a.size and (int(a.min()) < 0 or int(a.max()) > 0xFFFFFFFF)):
            return page_keys_reference(root, token_ids, page_size, extra_keys, parent, start_page)
        tb = a.astype("<u4")
    else:
        try:  # array('I') is uint32 wherever the kernel runs; the machine is little-endian (checked in _kernel)
            tb = array("I", token_ids if lo == 0 and hi == len(token_ids) else token_ids[lo:hi])
        except (OverflowError, TypeError):  # some page needs int64 (or holds a non-int): per page, through hashlib
            return page_keys_reference(root, token_ids, page_size, extra_keys, parent, start_page)
    return _hash_chain(parent if parent is not None else root, tb, n, 4 * page_size, _PERSON_U32)


def _np():
    import numpy

    return numpy


def _hash_chain(prev: bytes, tb, n: int, msglen: int, person: bytes) -> list[bytes]:
    np = _np()

    nblocks = max(1, -(-msglen // 128))
    if msglen == 128 * nblocks:
        words = np.frombuffer(tb, np.uint64).reshape(n, 16 * nblocks)  # no copy
    else:
        buf = np.zeros((n, 128 * nblocks), np.uint8)
        buf[:, :msglen] = np.frombuffer(tb, np.uint8).reshape(n, msglen)
        words = buf.view(np.uint64)
    out = np.empty((n, 2), np.uint64)
    s = np.frombuffer(prev, np.uint64)
    p = np.frombuffer(person, np.uint64)
    _KERNEL[0](words, nblocks, msglen, s[0], s[1], p[0], p[1], out)
    return split_keys(out.tobytes())


_SPLITTERS = [struct.Struct(f"{KEY_BYTES}s" * (1 << k)) for k in range(11)]  # 1 .. 1024 keys per call


def split_keys(b: bytes) -> list[bytes]:
    """``b`` (a multiple of 16 bytes) cut into 16-byte keys (struct does it in C, faster than slicing)."""
    out: list[bytes] = []
    n, off = len(b) // KEY_BYTES, 0
    big = _SPLITTERS[-1]
    while n >= 1024:
        out.extend(big.unpack_from(b, off))
        off += big.size
        n -= 1024
    k = 9
    while n:
        if n >= 1 << k:
            sp = _SPLITTERS[k]
            out.extend(sp.unpack_from(b, off))
            off += sp.size
            n -= 1 << k
        k -= 1
    return out


_KERNEL: list = []


def _kernel():
    """The compiled BLAKE2b chain loop, or None (numba missing, big-endian host, or TIERKV_PAGE_HASH=hashlib)."""
    if not _KERNEL:
        fn = None
        if sys.byteorder == "little" and array("I").itemsize == 4 and os.environ.get("TIERKV_PAGE_HASH", "") != "hashlib":
            try:
                from ._blake2b_numba import blake2b_chain as fn
            except ImportError:
                fn = None
        _KERNEL.append(fn)
    return _KERNEL[0]


def warm_up() -> bool:
    """Load (or compile, first time on a machine: seconds) the compiled loop now rather than in the first lookup.
    Returns whether it is in use."""
    if _kernel() is None:
        return False
    root = bytes(KEY_BYTES)
    page_keys(root, list(range(4 * KERNEL_MIN_PAGES)), 4)
    return True


class RequestKeys:
    """Incrementally extended key chain of one growing sequence (prompt, then generated tokens).

    ``extend(all_token_ids)`` hashes only the pages that became full since the last call (O(1) when none did: it
    reads only ``len(all_token_ids)``); ``keys`` is the list of 16-byte keys of all full pages so far and
    ``hashed_pages`` counts the pages this object hashed (each page once).
    """

    __slots__ = ("root", "page_size", "keys", "hashed_pages")

    def __init__(self, root: bytes, page_size: int):
        self.root = root
        self.page_size = page_size
        self.keys: list[bytes] = []
        self.hashed_pages = 0

    def extend(self, token_ids: Sequence[int]) -> list[bytes]:
        n_full = len(token_ids) // self.page_size
        if n_full > len(self.keys):
            start = len(self.keys)
            parent = self.keys[-1] if self.keys else None
            self.keys.extend(page_keys(self.root, token_ids, self.page_size,
                                       parent=parent, start_page=start))
            self.hashed_pages += n_full - start
        return self.keys


def key_hex(keys: Iterable[bytes]) -> list[str]:
    """Text form of keys (32 lowercase hex chars each), as stored in L3."""
    return [k.hex() for k in keys]
