"""Structured linear layers, written once for every hf_symmetry family that stores structured matrices
(the compressed Llama family and the RMS decoder family) and shipped next to their checkpoints.

Each class names its config ``"type"`` (``kind``) and is registered under it in :data:`LINEAR_CLASSES`
when it is defined: the factory :func:`structured_linear`, the configs' :data:`STRUCTURE_TYPES`, the entry
keys a config entry needs (``entry_keys``), and everything outside this file (the ``--structure`` choices,
PEFT's targets) read that registry.

* :class:`KroneckerLinear`  ``W = Σ_s A_s ⊗ B_s``: two small contractions, ``r (m1 n1 + m2 n2)`` params;
* :class:`GSLinear`         ``W = L · P · R`` (block-diagonal, shuffle, block-diagonal): two batched matmuls;
* :class:`LowRankLinear`    ``W = U V``;
* :class:`DenseLinear`      an ordinary matrix (e.g. the paper leaves V dense).

Also here: :class:`StructuredEmbedding` (token rows of a structured matrix) and the orthogonal skip
connection :class:`OrthogonalSkip` with its Cayley map :func:`cayley_decode`.

This file is copied next to saved checkpoints for ``trust_remote_code`` loading (the families import it
relatively): it imports only torch and transformers.
"""

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

#: the structured linear classes by their config ``"type"`` (filled as each class is defined)
LINEAR_CLASSES: dict = {}


class StructuredLinear(nn.Module):
    """``y = x Wᵀ (+ b)`` for a structured ``W [out_features, in_features]``. Subclasses set ``kind`` (their
    config ``"type"``, which registers them) and ``entry_keys`` (what the config entry holds besides the
    type), and implement ``from_entry``, ``_matmul(x2d)`` (or a ``forward`` of their own), ``rows(ids)`` (rows
    of W, for embeddings), ``init_factors(std)`` (random initialisation) and ``dense_weight()`` (for tests and
    inspection only)."""

    kind: ClassVar[str]
    entry_keys: ClassVar[tuple[str, ...]] = ()
    #: a marker that survives remote-code loading (the class may come from a checkpoint's own copy)
    is_structured_linear: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            LINEAR_CLASSES[cls.kind] = cls

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    @classmethod
    def from_entry(cls, in_features: int, out_features: int, entry: dict, bias: bool) -> "StructuredLinear":
        raise NotImplementedError

    def forward(self, x: torch.Tensor, embed: bool = False) -> torch.Tensor:
        """``x Wᵀ (+ b)``; with ``embed``, ``x`` holds token ids and the rows ``W[x]`` come back (the
        embedding's lookup goes through this module's call, so that hooks on it see its parameters:
        accelerate's offloading loads them there)."""
        if embed:
            return self.rows(x)
        y = self._matmul(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """Random initialisation for ``from_config``: entries of W near N(0, std²), bias zero (parameters a
        checkpoint loaded are left alone: transformers' ``initialization`` functions skip them)."""
        self.init_factors(std)
        if self.bias is not None:
            init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class DenseLinear(StructuredLinear):
    kind = "dense"

    def __init__(self, in_features, out_features, bias=False):
        super().__init__(in_features, out_features, bias)
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    @classmethod
    def from_entry(cls, in_features, out_features, entry, bias):
        return cls(in_features, out_features, bias)

    def forward(self, x: torch.Tensor, embed: bool = False) -> torch.Tensor:
        """One ``F.linear`` on any leading dims, bias included (no reshapes: the fewest calls per token)."""
        return self.rows(x) if embed else F.linear(x, self.weight, self.bias)

    def rows(self, ids):
        return F.embedding(ids, self.weight)

    def init_factors(self, std):
        init.normal_(self.weight, mean=0.0, std=std)

    def dense_weight(self):
        return self.weight


class KroneckerLinear(StructuredLinear):
    """``W = Σ_{s<r} A_s ⊗ B_s`` with ``A_s [m1, n1]``, ``B_s [m2, n2]`` (``(A ⊗ B)[i1 m2 + i2, j1 n2 + j2]
    = A[i1, j1] B[i2, j2]``). Stored factor-row-major so that both contraction orders are plain
    matmuls on views: ``kron_a[i, s, j] = A_s[i, j]`` (``[m1, r, n1]``), ``kron_b[i, s, j] = B_s[i, j]``
    (``[m2, r, n2]``). The cheaper contraction order is fixed at construction."""

    kind = "kron"
    entry_keys = ("rank", "a_shape")

    def __init__(self, in_features, out_features, rank: int, a_shape, bias=False):
        super().__init__(in_features, out_features, bias)
        m1, n1 = (int(a) for a in a_shape)
        if m1 <= 0 or n1 <= 0 or out_features % m1 or in_features % n1:
            raise ValueError(
                f"Kronecker factor shape {tuple(a_shape)} does not divide the {out_features}x{in_features} matrix"
            )
        m2, n2 = out_features // m1, in_features // n1
        self.rank, self.a_shape, self.b_shape = rank, (m1, n1), (m2, n2)
        self.kron_a = nn.Parameter(torch.empty(m1, rank, n1))
        self.kron_b = nn.Parameter(torch.empty(m2, rank, n2))
        # flops per token of each order: contract A first / B first
        self.a_first = rank * m1 * n2 * (n1 + m2) <= rank * m2 * n1 * (n2 + m1)

    @classmethod
    def from_entry(cls, in_features, out_features, entry, bias):
        return cls(in_features, out_features, int(entry["rank"]), entry["a_shape"], bias)

    def forward(self, x: torch.Tensor, embed: bool = False) -> torch.Tensor:
        """A reader's split (``A`` of ``1 x q``) and a writer's (``q x 1``) on any leading dims, with the bias in
        the last call (the fewest calls per token: they count when decoding one token); others as
        :meth:`_matmul`."""
        (m1, n1), (m2, n2), r = self.a_shape, self.b_shape, self.rank
        if embed or not ((self.a_first and m1 == 1) or (not self.a_first and n1 == 1)):
            return super().forward(x, embed)
        lead = x.shape[:-1]
        if self.a_first:
            xs = x.reshape(-1, n1, n2)
            u = torch.bmm(self.kron_a.reshape(r, n1).expand(xs.shape[0], r, n1), xs)  # [N, s, j2]
            return F.linear(u.view(*lead, r * n2), self.kron_b.reshape(m2, r * n2), self.bias)
        t = F.linear(x, self.kron_b.reshape(m2 * r, n2)).view(-1, m2, r)  # [N, i2, s]
        a = self.kron_a.reshape(m1, r).expand(t.shape[0], m1, r)
        if self.bias is None:
            return torch.bmm(a, t.transpose(1, 2)).view(*lead, m1 * m2)
        return torch.baddbmm(self.bias.view(m1, m2), a, t.transpose(1, 2)).view(*lead, m1 * m2)

    def _matmul(self, x):
        """Two matmuls on views of the stored factors, no permuted copy. A first: ``u[t, (i1, s), j2] =
        Σ_j1 A[i1, s, j1] x[t, j1, j2]`` (A broadcast over the tokens), then rows ``(t, i1)`` of u times
        ``kron_b`` as ``[m2, (s, j2)]``. B first (a writer's ``A`` of ``q x 1``, ``n1 = 1``): ``x`` times
        ``kron_b`` as ``[(i2, s), n2]``, then ``A [m1, s]`` times each token's ``[s, i2]``. The small factor
        goes through ``bmm`` expanded over the tokens: ``matmul`` folds a broadcast operand that requires grad
        into a copy (25x slower for A times 256 tokens of SmolLM2's width, measured)."""
        (m1, n1), (m2, n2), r, N = self.a_shape, self.b_shape, self.rank, x.shape[0]
        if self.a_first:
            u = torch.bmm(self.kron_a.reshape(m1 * r, n1).expand(N, -1, -1), x.reshape(N, n1, n2))  # [N, (i1, s), j2]
            return F.linear(u.reshape(N * m1, r * n2), self.kron_b.reshape(m2, r * n2)).reshape(N, m1 * m2)
        if n1 == 1:
            t = F.linear(x, self.kron_b.reshape(m2 * r, n2)).reshape(N, m2, r)  # [N, i2, s]
            return torch.bmm(self.kron_a.reshape(m1, r).expand(N, -1, -1), t.transpose(1, 2)).reshape(N, m1 * m2)
        t = F.linear(x.view(N, n1, n2), self.kron_b.reshape(m2 * r, n2))  # [N, n1, (i2, s)]
        t = t.view(N, n1, m2, r).permute(0, 2, 3, 1).reshape(N * m2, r * n1)  # [(N, i2), (s, j1)]
        y = F.linear(t, self.kron_a.reshape(m1, r * n1)).view(N, m2, m1)
        return y.transpose(1, 2).reshape(N, m1 * m2)

    def rows(self, ids):
        m2 = self.b_shape[0]
        flat = ids.reshape(-1)
        a, b = self.kron_a[flat // m2], self.kron_b[flat % m2]  # [N, r, n1], [N, r, n2]
        return torch.bmm(a.transpose(1, 2), b).reshape(*ids.shape, self.in_features)

    def init_factors(self, std):
        init.normal_(self.kron_a, mean=0.0, std=1.0 / self.rank**0.5)
        init.normal_(self.kron_b, mean=0.0, std=std / max(self.a_shape[1], 1) ** 0.5)

    def dense_weight(self):
        return torch.einsum("asc,bsd->abcd", self.kron_a, self.kron_b).reshape(self.out_features, self.in_features)

    def extra_repr(self):
        return f"{super().extra_repr()}, rank={self.rank}, a_shape={self.a_shape}, b_shape={self.b_shape}"


class GSLinear(StructuredLinear):
    """Group-and-shuffle ``W = L · P · R``: ``gs_right [kr, kl·b, in/kr]`` (block-diagonal, applied first),
    the shuffle routing ``b`` channels from every R-block to every L-block, ``gs_left [kl, out/kl, kr·b]``
    (block-diagonal). Tile (i, j) of W is ``gs_left[i][:, j-th b] @ gs_right[j][i-th b, :]``."""

    kind = "gs"
    entry_keys = ("rank", "blocks")

    def __init__(self, in_features, out_features, rank: int, blocks, bias=False):
        super().__init__(in_features, out_features, bias)
        kl, kr = (int(k) for k in blocks)
        if kl <= 0 or kr <= 0 or out_features % kl or in_features % kr:
            raise ValueError(f"GS blocks {tuple(blocks)} do not divide the {out_features}x{in_features} matrix")
        self.kl, self.kr, self.rank = kl, kr, rank
        self.gs_left = nn.Parameter(torch.empty(kl, out_features // kl, kr * rank))
        self.gs_right = nn.Parameter(torch.empty(kr, kl * rank, in_features // kr))

    @classmethod
    def from_entry(cls, in_features, out_features, entry, bias):
        return cls(in_features, out_features, int(entry["rank"]), entry["blocks"], bias)

    #: tokens from which one CPU thread runs :meth:`_accumulated` (measured crossover at SmolLM2's shapes, issue 47)
    accumulate_from: ClassVar[int] = 256

    def forward(self, x: torch.Tensor, embed: bool = False) -> torch.Tensor:
        """One token as :meth:`_one_token`; many tokens on one CPU thread as :meth:`_accumulated`; otherwise
        two batched matmuls on any leading dims, the shuffle a copy between them (fewest calls: with threads,
        compiled, on GPUs or with autograd). Each choice is a static branch under compile."""
        if embed:
            return self.rows(x)
        if x.numel() == self.in_features:
            y = self._one_token(x)
        elif self._accumulates(x):
            y = self._accumulated(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        else:
            y = self._batched(x)
        return y if self.bias is None else y + self.bias

    def _accumulates(self, x: torch.Tensor) -> bool:
        """Whether :meth:`_accumulated` runs: eager, on the CPU, one thread, several row blocks, ``accumulate_from``
        tokens or more, no autograd (its products write into views through ``out=``). With two threads its
        strided in-place products measured 2-7x slower than :meth:`_batched` (issue 47, load 3-7 on 2 cores); with
        one row block (an embedding's plan) :meth:`_batched` copies no output and writes it once, not ``kr`` times
        (1.21 against 1.09x dense for the 49152x576 head at 512 tokens)."""
        if torch.compiler.is_compiling() or x.device.type != "cpu" or torch.get_num_threads() != 1 or self.kl == 1:
            return False
        grads = torch.is_grad_enabled() and any(t.requires_grad for t in (x, self.gs_left, self.gs_right))
        return not grads and x.numel() >= self.accumulate_from * self.in_features

    def _batched(self, x: torch.Tensor) -> torch.Tensor:
        """Two batched matmuls, the shuffle a copy between them and the output's transpose a copy after."""
        kl, kr, b = self.kl, self.kr, self.rank
        xs = x.reshape(-1, kr, self.in_features // kr).transpose(0, 1)  # [kr, N, in/kr]
        N = xs.shape[1]
        h = torch.bmm(xs, self.gs_right.mT).view(kr, N, kl, b)  # [kr, N, i, c]
        h = h.transpose(0, 2).reshape(kl, N, kr * b)  # shuffle: [kl, N, (j, c)]
        return torch.bmm(h, self.gs_left.mT).transpose(0, 1).reshape(*x.shape[:-1], self.out_features)

    def _accumulated(self, x: torch.Tensor) -> torch.Tensor:
        """Many tokens ``x [N, in]`` without a copy: the right factor in one batched matmul (``h [j, N, (i, c)]``),
        then the left one as ``kr`` batched products over the row blocks ``i``, one per right block ``j``,
        accumulated straight into the output's layout ``[N, i, p]`` (the shuffle is which slice of ``h`` and of
        ``gs_left`` each product reads). Two temporaries (h and the output) where :meth:`_batched` has four:
        1.04-1.39x faster than it at SmolLM2's shapes (GS at 75 and 50 %), 512 and 4096 tokens, one thread."""
        kl, kr, b = self.kl, self.kr, self.rank
        N, q, p = x.shape[0], self.in_features // kr, self.out_features // kl
        h = torch.bmm(x.reshape(N, kr, q).transpose(0, 1), self.gs_right.mT).view(kr, N, kl, b)  # [j, N, i, c]
        left = self.gs_left.view(kl, p, kr, b)  # [i, p, j, c]
        y = torch.empty(N, kl, p, dtype=h.dtype, device=h.device)
        yt = y.transpose(0, 1)  # [i, N, p], a view
        torch.bmm(h[0].transpose(0, 1), left[:, :, 0].mT, out=yt)
        for j in range(1, kr):
            yt.baddbmm_(h[j].transpose(0, 1), left[:, :, j].mT)
        return y.view(N, self.out_features)

    def _one_token(self, x: torch.Tensor) -> torch.Tensor:
        """One token (decoding: reading the weights is the cost): each factor in one ``mm`` with the weights on
        the left, every input block against every weight block (``kr`` resp. ``kl`` times the arithmetic, the
        weights read once), then the diagonal blocks. A batched matmul runs one small GEMM per block: decoding
        SmolLM2's gs outputs took 1.1-1.25x longer that way on CPU (measured, issue 47). With weights that stay
        in cache the extra arithmetic costs more than it saves (a model that small decodes fast either way)."""
        kl, kr, b = self.kl, self.kr, self.rank
        q, p = self.in_features // kr, self.out_features // kl
        y1 = torch.mm(self.gs_right.view(kr * kl * b, q), x.reshape(kr, q).t())  # [(j, i, c), j']
        h = y1.view(kr, kl * b, kr).diagonal(0, 0, 2).view(kl, b, kr).transpose(1, 2)  # shuffle: [i, j, c]
        y2 = torch.mm(self.gs_left.view(kl * p, kr * b), h.reshape(kl, kr * b).t())  # [(i, p), i']
        return y2.view(kl, p, kl).diagonal(0, 0, 2).t().reshape(x.shape[:-1] + (self.out_features,))

    def rows(self, ids):
        kl, kr, b = self.kl, self.kr, self.rank
        flat = ids.reshape(-1)
        bl = self.out_features // kl
        right = self.gs_right.view(kr, kl, b, -1)
        if kl == 1:  # one row block (an embedding's plan): every token's rows in one product, no selection
            left = self.gs_left[0][flat].view(-1, kr, b).transpose(0, 1)  # [kr, N, b]
            return torch.bmm(left, right[:, 0]).transpose(0, 1).reshape(*ids.shape, self.in_features)
        if torch.compiler.is_compiling():  # no data-dependent shapes: each block's rows for every token, then pick
            block, out = flat // bl, None
            for i in range(kl):
                left = self.gs_left[i][flat % bl].view(-1, kr, b).transpose(0, 1)  # [kr, N, b]
                rows_i = torch.bmm(left, right[:, i]).transpose(0, 1).reshape(-1, self.in_features)
                out = rows_i if out is None else torch.where((block == i)[:, None], rows_i, out)
            return out.reshape(*ids.shape, self.in_features)
        out = torch.empty(flat.shape[0], self.in_features, dtype=self.gs_left.dtype, device=flat.device)
        for i in range(kl):
            sel = (flat // bl) == i
            if kl > 1 and not bool(sel.any()):
                continue
            left = self.gs_left[i][flat[sel] % bl].view(-1, kr, b).transpose(0, 1)  # [kr, n_i, b]
            out[sel] = torch.bmm(left, right[:, i]).transpose(0, 1).reshape(-1, self.in_features)
        return out.reshape(*ids.shape, self.in_features)

    def init_factors(self, std):
        init.normal_(self.gs_left, mean=0.0, std=1.0 / (self.kr * self.rank) ** 0.5)
        init.normal_(self.gs_right, mean=0.0, std=std * self.kr**0.5)

    def dense_weight(self):
        kl, kr, b = self.kl, self.kr, self.rank
        left = self.gs_left.view(kl, -1, kr, b)
        right = self.gs_right.view(kr, kl, b, -1)
        return torch.einsum("ipjc,jicq->ipjq", left, right).reshape(self.out_features, self.in_features)

    def extra_repr(self):
        return f"{super().extra_repr()}, blocks=({self.kl}, {self.kr}), rank={self.rank}"


class LowRankLinear(StructuredLinear):
    """``W = U V``: ``lr_u [out, r]``, ``lr_v [r, in]``."""

    kind = "lowrank"
    entry_keys = ("rank",)

    def __init__(self, in_features, out_features, rank: int, bias=False):
        super().__init__(in_features, out_features, bias)
        self.rank = rank
        self.lr_u = nn.Parameter(torch.empty(out_features, rank))
        self.lr_v = nn.Parameter(torch.empty(rank, in_features))

    @classmethod
    def from_entry(cls, in_features, out_features, entry, bias):
        return cls(in_features, out_features, int(entry["rank"]), bias)

    def forward(self, x: torch.Tensor, embed: bool = False) -> torch.Tensor:
        """Two ``F.linear`` on any leading dims, bias in the second (no reshapes: the fewest calls per token)."""
        return self.rows(x) if embed else F.linear(F.linear(x, self.lr_v), self.lr_u, self.bias)

    def rows(self, ids):
        return F.embedding(ids, self.lr_u) @ self.lr_v

    def init_factors(self, std):
        init.normal_(self.lr_u, mean=0.0, std=std**0.5 / self.rank**0.25)
        init.normal_(self.lr_v, mean=0.0, std=std**0.5 / self.rank**0.25)

    def dense_weight(self):
        return self.lr_u @ self.lr_v

    def extra_repr(self):
        return f"{super().extra_repr()}, rank={self.rank}"


#: the config ``"type"`` of every structured linear, in registration order (config validation)
STRUCTURE_TYPES = tuple(LINEAR_CLASSES)


def check_entry(where: str, entry) -> None:
    """``ValueError`` (naming ``where``) unless ``entry`` is a config structure entry: a dict whose ``"type"``
    is a registered class, with that class's ``entry_keys``."""
    if not isinstance(entry, dict) or entry.get("type") not in LINEAR_CLASSES:
        raise ValueError(f"{where} must be a dict with 'type' in {tuple(LINEAR_CLASSES)}, got {entry!r}")
    missing = [k for k in LINEAR_CLASSES[entry["type"]].entry_keys if k not in entry]
    if missing:
        raise ValueError(f"{where} ({entry['type']}) lacks {missing}")


def structured_linear(in_features: int, out_features: int, entry: dict) -> StructuredLinear:
    """The module a config structure entry describes."""
    cls = LINEAR_CLASSES.get(entry["type"])
    if cls is None:
        raise ValueError(f"unknown structure type {entry['type']!r}")
    return cls.from_entry(in_features, out_features, entry, bool(entry.get("bias", False)))


class StructuredEmbedding(nn.Embedding):
    """Token embeddings as rows of a structured ``[vocab, d]`` matrix (``matrix``), looked up through the
    matrix module's own call (so that hooks on it, such as accelerate's offloading, see its parameters).

    An ``nn.Embedding`` as transformers' ``resize_token_embeddings`` needs one: when the matrix is dense,
    ``weight`` is its ``[vocab, d]`` table, and setting ``weight`` (the resize swaps in a longer table)
    sets the dense matrix's. A structured matrix has no table of rows to extend: its ``weight`` is an
    ``AttributeError`` that says so."""

    def __init__(self, vocab_size: int, dim: int, entry: dict):
        nn.Module.__init__(self)  # no table of its own: the rows come from `matrix`
        self.num_embeddings, self.embedding_dim, self.padding_idx = vocab_size, dim, None
        self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse = None, 2.0, False, False
        self.matrix = structured_linear(dim, vocab_size, {**entry, "bias": False})

    def __getattr__(self, name: str):
        if name == "weight":
            matrix = self._modules["matrix"]
            if isinstance(matrix, DenseLinear):
                return matrix.weight
            raise AttributeError(
                f"this token embedding is a {type(matrix).__name__} (structured) matrix and has no dense `weight` "
                "table: resize_token_embeddings needs a dense embedding"
            )
        return super().__getattr__(name)

    def __setattr__(self, name: str, value) -> None:
        if name == "weight":
            if not isinstance(self.matrix, DenseLinear):
                raise AttributeError(f"a {type(self.matrix).__name__} token embedding cannot take a dense `weight`")
            self.matrix.weight = value
            self.matrix.out_features = value.shape[0]
            return
        super().__setattr__(name, value)
        if name == "num_embeddings" and isinstance(self._modules.get("matrix"), DenseLinear):
            self.matrix.out_features = value  # the table was resized in place (resize_token_embeddings)

    def forward(self, input_ids):
        return self.matrix(input_ids, embed=True)

    def init_weights(self, std: float) -> None:
        pass  # its matrix is initialised as a structured linear

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


def cayley_decode(k: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``diag(signs) (I + K)(I − K)⁻¹`` with K skew-symmetric, upper triangle ``k`` (row-major);
    computed in float64 and returned in ``k``'s dtype. ``I − K`` is always invertible (K is skew)."""
    d = signs.shape[0]
    iu = torch.triu_indices(d, d, 1, device=k.device)
    K = torch.zeros(d, d, dtype=torch.float64, device=k.device)
    K[iu[0], iu[1]] = k.to(torch.float64)
    K = K - K.T
    eye = torch.eye(d, dtype=torch.float64, device=k.device)
    C = torch.linalg.solve((eye - K).T, (eye + K).T).T
    return (signs.to(torch.float64)[:, None] * C).to(k.dtype)


class OrthogonalSkip(nn.Module):
    """``x -> x S`` for an orthogonal ``S = Q_prevᵀ Q_next`` stored as ``d(d+1)/2`` numbers
    (``skip_k``: Cayley parameter; ``skip_signs``: ±1). S is formed once into the non-persistent buffer
    ``skip_matrix``: at initialisation and after loading (``init_weights``), and again by an eager call
    when ``skip_k`` or ``skip_signs`` changed (``.to()``, in-place edits, optimizer steps). Compiled and
    exported graphs read the buffer as it is (they cannot see tensor versions): after editing the
    parameters, ``refresh()`` (or one eager call) before compiling. While training with a trainable
    ``skip_k``, S is formed on every call, so that gradients flow."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.skip_k = nn.Parameter(torch.zeros(dim * (dim - 1) // 2))
        self.register_buffer("skip_signs", torch.ones(dim))
        self.register_buffer("skip_matrix", torch.eye(dim), persistent=False)  # S of skip_k = 0, signs = 1
        self._formed_from: tuple | None = None  # the parameters skip_matrix was formed from

    def _parameters_now(self) -> tuple:
        k, signs = self.skip_k, self.skip_signs
        return (k.data_ptr(), k._version, signs.data_ptr(), signs._version, k.dtype, k.device)

    @torch.no_grad()
    def refresh(self) -> None:
        """Form ``S`` from ``skip_k`` and ``skip_signs`` into ``skip_matrix`` (skipped while the parameters
        are on the meta device: offloaded or not loaded yet)."""
        if self.skip_k.is_meta or self.skip_signs.is_meta:
            return
        self.skip_matrix = cayley_decode(self.skip_k.detach(), self.skip_signs)
        self._formed_from = self._parameters_now()

    @torch.no_grad()
    def init_weights(self, std: float = 0.0) -> None:
        """The identity skip (parameters a checkpoint loaded are left alone), then ``S`` of what it holds."""
        init.zeros_(self.skip_k)
        init.ones_(self.skip_signs)
        self.refresh()  # S of the loaded (or initialised) parameters

    def matrix(self) -> torch.Tensor:
        if self.training and self.skip_k.requires_grad and torch.is_grad_enabled():
            return cayley_decode(self.skip_k, self.skip_signs)
        if not torch.compiler.is_compiling() and self._formed_from != self._parameters_now():
            self.refresh()
        return self.skip_matrix

    def forward(self, x):
        return x @ self.matrix()


__all__ = [
    "LINEAR_CLASSES",
    "STRUCTURE_TYPES",
    "StructuredLinear",
    "DenseLinear",
    "KroneckerLinear",
    "GSLinear",
    "LowRankLinear",
    "check_entry",
    "structured_linear",
    "StructuredEmbedding",
    "OrthogonalSkip",
    "cayley_decode",
]
