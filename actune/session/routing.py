"""The function mode of :func:`actune.compressed`: it sees each functional call and routes it.

A ``TorchFunctionMode`` sees every call of a function of ``torch``, ``torch.nn.functional`` or
a tensor method (modules call them too). For a call that records gradients it looks the
function up in the rule registry (:mod:`actune.rules`) once: the rule may run the op through
an autograd function that saves less, and otherwise names which of the level's bit widths
the saved-tensor hooks give what the op saves. It then records the op being run on the
session, so the pack hook knows whose tensor it packs, and on statistics steps of the bit
allocator tells it how rounding noise in what the op saved reaches parameter gradients.

Saving that another mechanism owns (a checkpointed region, ``save_on_cpu``, whose
saved-tensor hooks are above actune's) is left to it: the op runs as it is.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F  # noqa: N812
from torch.overrides import TorchFunctionMode

from actune import tunables
from actune.autoprec.allocator import AutoPrecision
from actune.packing.kernels import COMPILE
from actune.packing.kernels import compiling as _compiling
from actune.rules import RULES, funcs_of, rule_for
from actune.rules.matmuls import CONVS, PLAIN_CONVS
from actune.rules.norms import unit_vectors
from actune.substitutes.functions import arg, as_tuple
from actune.traced import dispatch, traced

__all__ = ["OUTSIDE_OPS", "FunctionMode", "OpLabel"]

_MATMULS = funcs_of("matmul")
_NORMS = funcs_of("norm")
_dynamo_compiling = torch.compiler.is_dynamo_compiling


#: The innermost saved-tensor hooks (pack, unpack), or None.
top_hooks = torch._C._autograd._top_saved_tensors_default_hooks


_PLAIN = torch.Tensor


def _is_parameter(t: torch.Tensor) -> bool:
    """``isinstance(t, nn.Parameter)`` without the metaclass's check for a plain tensor (a
    Python call that cost more than the rest of the pack hook): only a subclass can be one in
    eager code."""
    return type(t) is not _PLAIN and isinstance(t, torch.nn.Parameter)


#: Tensor methods that read metadata and save nothing: run at once, not routed.
_QUERIES = frozenset({torch.Tensor.dim, torch.Tensor.size, torch.Tensor.stride,
                      torch.Tensor.numel, torch.Tensor.is_contiguous, torch.Tensor.element_size,
                      torch.Tensor.is_floating_point, torch.Tensor.data_ptr,
                      torch.Tensor.__len__, torch.Tensor.ndimension, torch.Tensor.nelement})


def parameter_like(t: torch.Tensor) -> bool:
    """A parameter, a view of one (a transposed weight) or its autocast copy."""
    if t.is_leaf:  # (a parameter is a leaf: most saved tensors skip the slow isinstance)
        if t.requires_grad or _is_parameter(t):
            return True
        # a frozen weight's transpose (a LoRA model's base layer) is a leaf view: rounding it
        # would add noise to every input gradient below and save nothing
        base = t._base
        return base is not None and _is_parameter(base)
    base = t._base
    if base is not None:  # a view: of a weight (transposed) or of an autocast copy of one
        if base.is_leaf:
            return _is_parameter(base)
        t = base
    fn = t.grad_fn  # an autocast copy of a parameter: ToCopyBackward0 -> AccumulateGrad
    if fn is not None and type(fn).__name__ == "ToCopyBackward0":  # (name() makes a string)
        nxt = fn.next_functions
        if len(nxt) != 1:
            return False
        node = nxt[0][0]
        for _ in range(2):  # or of a view of one (Falcon's x @ w.T casts w.T)
            if type(node).__name__ not in _VIEW_NODES:
                break
            node = node.next_functions[0][0]
        return type(node).__name__ == "AccumulateGrad"
    return False


#: Backward nodes of views that keep a contiguous tensor's element order.
ORDER_KEEPING_VIEWS = frozenset({"ViewBackward0", "UnsafeViewBackward0",
                                 "ReshapeAliasBackward0", "AliasBackward0"})
#: Backward nodes of views (what a copy of a parameter's view passes through to its leaf).
_VIEW_NODES = ORDER_KEEPING_VIEWS | {"TBackward0", "TransposeBackward0", "PermuteBackward0",
                                     "ExpandBackward0"}


#: Functions with a rule that may take their tensors in one list argument.
_LISTED = frozenset({torch.einsum})


def _needs_grad(args: tuple, kwargs: dict, func=None) -> bool:
    """Does the call record gradients (grad mode on, a tensor argument that requires them, or
    for ``_LISTED`` functions one in a list argument: ``torch.einsum(equation, [a, b])``)?"""
    if not torch.is_grad_enabled():
        return False
    for a in args:
        if isinstance(a, torch.Tensor) and a.requires_grad:
            return True
    if func in _LISTED:
        for a in args:
            if isinstance(a, list | tuple) and any(
                    isinstance(t, torch.Tensor) and t.requires_grad for t in a):
                return True
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, torch.Tensor) and a.requires_grad:
                return True
    return False


class OpLabel:
    """What the op being run tells the pack hook about what it saves: the function, which of
    the level's widths its rule names (``kind``), a norm's input shape (``only_shape``: only
    tensors of that shape are rounded) and the ids of its references (weight, buffers), whether
    it saves features-last tensors, the ids it keeps exact on purpose, with why (a broadcast
    operand, a weight computed in forward), the shapes of the frozen weights a matmul reads,
    and whether it multiplies two activations (``pair``: each operand's rounding noise meets
    the other's in backward). One object a call, swapped in and out whole: a call without a
    rule shares its function's own, made once (``_ROUTES``); a rule's call gets a fresh one
    (:func:`_label`), which its rule may add ``exact_ids`` to."""

    __slots__ = ("exact_ids", "features", "frozen_shapes", "kind", "only_shape", "op", "pair",
                 "references")

    def __init__(self, op=None, kind: str | None = None, only_shape: torch.Size | None = None,
                 references: set[int] | tuple = (), features: bool = False,
                 frozen_shapes: frozenset | tuple = (), pair: bool = False) -> None:
        self.op, self.kind, self.only_shape, self.references = op, kind, only_shape, references
        self.features, self.frozen_shapes, self.pair = features, frozen_shapes, pair
        self.exact_ids: dict[int, str] | tuple = ()

    def with_kind(self, kind: str | None) -> OpLabel:
        """This label, but naming the level's ``kind`` width."""
        label = OpLabel(self.op, kind, self.only_shape, self.references, self.features,
                        self.frozen_shapes, self.pair)
        label.exact_ids = self.exact_ids
        return label


#: Outside any routed call.
OUTSIDE_OPS = OpLabel()


#: What a query (``_QUERIES``) routes to: run at once.
_QUERY = object()
#: function -> (its rule, None or ``_QUERY``; the label of a call without a rule), for the
#: eager path (bounded: a model calling ever new function objects, lambdas made per call, is
#: looked up each time past it).
_ROUTES: dict = {}
RULES.listeners.append(_ROUTES.clear)  # (a rule added or taken out: decided afresh)


def _route_of(func) -> tuple:
    """What the eager path does with ``func``, remembered (unhashable callables: looked up)."""
    try:
        hash(func)
    except TypeError:
        return rule_for(func), OpLabel(func)
    route = (_QUERY if func in _QUERIES else rule_for(func), OpLabel(func))
    if len(_ROUTES) < tunables.GENERIC_RULE_CACHE:
        _ROUTES[func] = route
    return route


class FunctionMode(TorchFunctionMode):
    """Routes each call that records gradients through its rule (see the module docstring)."""

    #: run a rule's replacement where it has one (:class:`LabelMode`: never)
    substitutes = True

    def __init__(self, session) -> None:
        super().__init__()
        self.s = session

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # (the one check before the eager path; Dynamo reads is_dynamo_compiling as a
        # constant while it traces and guards on nothing; the flag, read only outside Dynamo,
        # is torch's for the rest of a compile session)
        if _dynamo_compiling() or COMPILE._is_compiling_flag:
            return self._compiling_call(func, types, args, kwargs)
        try:
            rule, label = _ROUTES[func]  # (eager: decided once per function)
        except (KeyError, TypeError):
            rule, label = _route_of(func)
        s = self.s
        ap = s.allocating
        if rule is None and s.reentrant_level is None and (
                ap is None or not (ap.collecting or ap.tracking)):
            # most calls (views, additions, a model's own plumbing): what they save stays
            # exact, so the label says no rule, with no further test of the call (an
            # allocator's statistics step watches them, and its first output is tracked)
            previous, s.label = s.label, label
            try:
                return func(*args, **(kwargs or {}))
            finally:
                s.label = previous
        kwargs = kwargs or {}
        if rule is _QUERY or not args or not _needs_grad(args, kwargs, func):
            return func(*args, **kwargs)  # (a batch norm asks its input's dim() each call)
        return self._routed(func, rule, args, kwargs)

    def _compiling_call(self, func, types, args, kwargs):
        """A call while torch.compile traces or compiles: the traced rules, or the eager
        routing outside the graph (see ``_eagerly``)."""
        kwargs = kwargs or {}
        if func in _QUERIES or not args or not _needs_grad(args, kwargs, func):
            return func(*args, **kwargs)
        if traced():  # Dynamo traces this: the traced rules (torch.compiler.is_compiling:
            # Dynamo guards on a read of torch's own flag and would compile again each call)
            return dispatch(self.s.level, func, args, kwargs) if self.substitutes \
                else func(*args, **kwargs)
        if _compiling():  # (see _eagerly below)
            return _eagerly(self, func, types, args, kwargs)
        return self._routed(func, rule_for(func), args, kwargs)

    def _routed(self, func, rule, args, kwargs):
        """An eager call that records gradients, through ``rule`` (None: none applies)."""
        s = self.s
        top = top_hooks(False)
        if top is None or top[0] is not s.hook:  # a checkpointed region, save_on_cpu...
            return func(*args, **kwargs)
        if s.reentrant_level is not None:  # a reentrant checkpoint's output, maybe
            s.reentrant_outputs(args)
        ap = s.allocating
        if ap is None or not ap.collecting:
            out = self._run(func, rule, args, kwargs)
            if ap is not None and ap.tracking:
                ap.track(_first_tensor(out))
            return out
        # a statistics step: the gradient of this op's output weighs the slots it reads
        outer, s.packer.touched = s.packer.touched, []
        try:
            out = self._run(func, rule, args, kwargs)
        finally:
            touched, s.packer.touched = s.packer.touched, outer
        first = _first_tensor(out)
        if first is not None and (touched or func in _MATMULS or func is F.embedding):
            self._watch(ap, touched, first, func, args, kwargs)
        if ap.tracking:
            ap.track(first)
        return out

    def _run(self, func, rule, args, kwargs):
        s = self.s
        previous, s.label = s.label, _label(s, func, rule, args, kwargs)
        try:
            if (self.substitutes and rule is not None and rule.replace is not None
                    and not s.level.exact and isinstance(args[0], torch.Tensor)):
                out = rule.replace(s, func, args, kwargs, s.level)
                if out is not None:
                    return out
            return func(*args, **kwargs)
        finally:
            s.label = previous

    def _watch(self, ap: AutoPrecision, touched: list[int], out: torch.Tensor, func, args,
               kwargs) -> None:
        """Tell the allocator how rounding noise in what ``func`` saved reaches parameter
        gradients (statistics steps only; device scalars, no synchronisation; derivation in
        docs/autoprec.md). A matmul's input noise enters its own weight gradient, ``fan_in``
        elements per output gradient element; the size of that weight gradient,
        ``fan_in * mean(x**2) * |grad|**2``, is what noise relayed from above it perturbs. An
        elementwise op's noise enters the gradient of its input and is relayed to every weight
        gradient below it (a norm's noise relative to its input's spread, hence ``1 / var``)."""
        x = _operand(func, args)
        if func in _MATMULS:
            fan = _fan_in(func, args, kwargs)
            size = (x.detach().float().square().mean() * fan
                    if isinstance(x, torch.Tensor) and x.is_floating_point() else None)
            ap.watch(touched, out, fan, relayed=False, size=size)
            self.s.last_matmul = (weakref.ref(out), func, args, kwargs)
            return
        if func is F.embedding:  # its weight gradient is the output gradient, scattered
            ap.watch(touched, out, 1.0, relayed=False, size=torch.ones((), device=out.device))
            return
        if func in _NORMS and isinstance(x, torch.Tensor) and x.dim() >= 2:
            dims = (0, *range(2, x.dim())) if func is F.batch_norm else (x.dim() - 1,)
            scale = (x.detach().float().var(dim=dims) + 1e-5).reciprocal().mean()
            weight = arg(args, kwargs, 3, "weight", None) if func is F.batch_norm else None
            coherent = None
            if isinstance(weight, torch.Tensor):
                coherent = _coherent(self.s.last_matmul, x, weight, dims)
            self.s.last_matmul = None  # holds the matmul's input: let it go
            ap.watch(touched, out, scale, relayed=True,
                     norm=(weight, dims, coherent) if isinstance(weight, torch.Tensor)
                     else None, reach_all=func is F.batch_norm)
            if isinstance(weight, torch.Tensor):  # and directly its own weight's gradient
                ap.watch(touched, out, scale, relayed=False)
            return
        ap.watch(touched, out, 1.0, relayed=True, reach_all=False)


def _label(s, func, rule, args, kwargs) -> OpLabel:
    """The label of a call of ``func`` through ``rule`` (None: no rule applies) for session
    ``s``: which op runs and how its rule keeps what it saves (the pack hook reads it)."""
    if rule is None:
        return OpLabel(func)
    if rule.weight_at == 1 and not kwargs and len(args) > 1:
        # (the most frequent routed calls: a linear layer's or a convolution's input times
        # its trainable weight, whose label depends on the two shapes alone (the arguments
        # after the bias are never tensors): made once per pair at this level)
        x, w = args[0], args[1]
        b = args[2] if len(args) > 2 else None
        if (isinstance(w, torch.Tensor) and w.is_leaf and w.requires_grad
                and (b is None or (isinstance(b, torch.Tensor) and b.is_leaf and b.requires_grad))
                and isinstance(x, torch.Tensor) and not parameter_like(x)):
            key = (func, x.shape, w.shape)
            made = s.weighted_labels.get(key)
            if made is not None and made[0] is rule:  # (a rule replaced since: made again)
                return made[1]
            label = _full_label(s, func, rule, args, kwargs)
            s.weighted_labels[key] = (rule, label)
            return label
    return _full_label(s, func, rule, args, kwargs)


def _full_label(s, func, rule, args, kwargs) -> OpLabel:
    """:func:`_label` of a call through ``rule``, from all of its arguments."""
    matmul = rule.category == "matmul"
    frozen, with_weight = (), False
    exact: dict[int, str] | tuple = ()
    if matmul:  # (one pass over the arguments, no generators: every conv and linear call)
        at = rule.weight_at
        operands = args
        if func in _LISTED and len(args) == 2 and isinstance(args[1], list | tuple):
            operands = (args[0], *args[1])  # (einsum's operands in one list)
        for i, a in enumerate(operands):
            if not isinstance(a, torch.Tensor):
                continue
            if parameter_like(a):
                with_weight = True
                if not a.requires_grad and _is_parameter(a):
                    # a frozen weight's autocast copy is no parameter, and rounding it would
                    # add noise to every input gradient below: the pack hook keeps it exact
                    # by its shape
                    frozen = frozenset((*frozen, a.shape))
            elif i == at:
                # a weight computed in forward (a parametrization's) or a constant one: kept
                # as PyTorch keeps it, never rounded as an activation
                with_weight, exact = True, {id(a): "weight"}
        if at is not None and kwargs:
            weight = kwargs.get("weight")
            if isinstance(weight, torch.Tensor) and not parameter_like(weight):
                with_weight, exact = True, {id(weight): "weight"}
    only, refs = None, ()
    if rule.only_input_shape and isinstance(args[0], torch.Tensor):
        # a norm's backward reads its statistics (mean, rstd) nonlinearly: only its input,
        # the tensor of the input's shape, may be rounded; its weight, bias and running
        # statistics are references
        only = args[0].shape
        refs = set(map(id, (*args[1:], *kwargs.values())))  # (identities: all may stay)
    # features last: a norm's input, or a matmul's activation times a weight (not two
    # activations, as attention's scores and probabilities are); or as the rule's test of
    # the call says (a batch norm's [batch, features] input)
    features = bool((rule.features_last and (not matmul or with_weight))
                    or (rule.features_last_if is not None and rule.features_last_if(args)))
    kind = rule.width
    if (features and matmul and s.level is not None
            and _widens(s.level, func, args, kwargs)):
        kind = NARROW
    elif (matmul and not with_weight and len(args) > 1
          and all(isinstance(a, torch.Tensor) and unit_vectors(a) for a in args[:2])):
        kind = SENSITIVE  # (a product of F.normalize's outputs: see unit_vectors)
    label = OpLabel(func, kind, only, refs, features, frozen, matmul and not with_weight)
    label.exact_ids = exact
    return label


class LabelMode(FunctionMode):
    """Names each op for the session and runs it as it is, never substituted: for a
    non-reentrant checkpoint's recomputation, whose saved tensors must be the ones PyTorch's
    own ops save (the original forward's graph reads them), packed as each op's rule bits say
    (:mod:`actune.session.recompute`; the session's ``hook`` is the recomputation's pack hook)."""

    substitutes = False


#: torch.compile cannot capture the routing (Python state, hooks): inside a compiled region
#: every call under compressed() runs eagerly, so compression stays correct. Only a call that
#: is being compiled takes this wrapper: eager code skips its cost (eight calls of its own).
_eagerly = torch.compiler.disable(FunctionMode.__torch_function__, recursive=True)


def _coherent(last, h: torch.Tensor, gamma: torch.Tensor, dims) -> torch.Tensor | None:
    """Per channel ``gamma**2 * invstd**4 * |sum x_hat * x_patch|**2 / M**2`` for a batch norm
    whose input ``h`` a convolution or linear layer just produced from ``x``: the factor by which
    the channel's rounding noise, shared by all its elements through the mean in batch norm's
    backward, reaches that layer's weight gradient coherently (docs/autoprec.md)."""
    if last is None or last[0]() is not h or last[1] not in (*CONVS, F.linear):
        return None
    _, func, args, kwargs = last
    x, w = args[0], arg(args, kwargs, 1, "weight", None)
    if not isinstance(w, torch.Tensor) or (func in CONVS and func not in PLAIN_CONVS):
        return None
    with torch.no_grad():
        hd = h.detach().float()
        mean = hd.mean(dim=dims, keepdim=True)
        invstd = (hd.var(dim=dims, unbiased=False, keepdim=True) + 1e-5).rsqrt()
        x_hat = (hd - mean) * invstd
        xd = x.detach().float()
        if func is F.linear:
            a = x_hat.reshape(-1, x_hat.shape[-1]).t() @ xd.reshape(-1, xd.shape[-1])
        else:
            stride = arg(args, kwargs, 3, "stride", 1)
            padding = arg(args, kwargs, 4, "padding", 0)
            dilation = arg(args, kwargs, 5, "dilation", 1)
            groups = arg(args, kwargs, 6, "groups", 1)
            if isinstance(padding, str):
                return None
            n = w.dim() - 2
            a = torch.ops.aten.convolution_backward(
                x_hat, xd, w.detach().float(), None, as_tuple(stride, n), as_tuple(padding, n),
                as_tuple(dilation, n), False, [0] * n, groups, [False, True, False])[1]
        count = h.numel() // h.shape[1]
        per_channel = a.reshape(a.shape[0], -1).square().sum(1)
        return (gamma.detach().float().square() * invstd.reshape(-1) ** 4 * per_channel
                / count**2)


@functools.lru_cache(maxsize=256)
def _inside_share(size: int, k: int, stride: int, pad: int, dilation: int) -> float:
    """The share of a kernel's taps, over all output positions, that land inside the input."""
    outputs = (size + 2 * pad - dilation * (k - 1) - 1) // stride + 1
    if outputs <= 0:
        return 1.0
    inside = sum(0 <= o * stride - pad + j * dilation < size
                 for o in range(outputs) for j in range(k))
    return inside / (outputs * k)


def _fan_in(func, args, kwargs) -> float:
    """How many saved elements each output element of ``func`` reads per weight (the factor
    by which rounding noise in its input reaches its weight gradient; 1 for elementwise ops)."""
    if func in CONVS:
        weight = arg(args, kwargs, 1, "weight", None)
        if not isinstance(weight, torch.Tensor):
            return 1
        fan = float(weight[0].numel())
        x = args[0]
        if func in PLAIN_CONVS and isinstance(x, torch.Tensor):
            n = weight.dim() - 2
            padding = arg(args, kwargs, 4, "padding", 0)
            if not isinstance(padding, str):  # taps that fall on the padding read nothing
                stride = as_tuple(arg(args, kwargs, 3, "stride", 1), n)
                dilation = as_tuple(arg(args, kwargs, 5, "dilation", 1), n)
                for size, k, st, p, d in zip(x.shape[-n:], weight.shape[2:], stride,
                                             as_tuple(padding, n), dilation, strict=True):
                    fan *= _inside_share(int(size), int(k), int(st), int(p), int(d))
        return fan
    x = _operand(func, args)
    if func in _MATMULS and isinstance(x, torch.Tensor) and x.dim():
        return int(x.shape[-1])
    return 1


#: Matmuls whose first argument is the term added (GPT-2's ``Conv1D`` is an ``addmm``): the
#: activation is the second.
_ADDED_FIRST = frozenset({torch.addmm, torch.baddbmm, torch.addbmm, torch.Tensor.addmm,
                          torch.Tensor.baddbmm})


def _operand(func, args):
    """The activation a call reads first: its first argument, or the second for
    ``addmm``-like calls (``bias + x @ w``)."""
    return args[1] if func in _ADDED_FIRST and len(args) > 1 else args[0]


#: The kind of a layer's input that keeps :attr:`Level.narrow_width`.
NARROW = "narrow"
#: The kind of what a rule names as read where rounding noise is amplified (a product of unit
#: vectors): :attr:`Level.sensitive_width`.
SENSITIVE = "sensitive"


def _widens(level, func, args, kwargs) -> bool:
    """Does ``func`` (a matmul with a weight) widen its activation as
    :meth:`Level.widens` says?"""
    x = _operand(func, args)
    if func is F.linear:
        weight = arg(args, kwargs, 1, "weight", None)
        out = weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else 0
    else:
        weight = args[2] if func in _ADDED_FIRST and len(args) > 2 else (
            args[1] if len(args) > 1 else None)
        out = weight.shape[-1] if isinstance(weight, torch.Tensor) and weight.dim() >= 2 else 0
    return isinstance(x, torch.Tensor) and x.dim() > 0 and level.widens(x.shape[-1], out)


def _first_tensor(out) -> torch.Tensor | None:
    """``out`` if it is a tensor, else the first tensor of a tuple or list of outputs."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple | list):
        return next((o for o in out if isinstance(o, torch.Tensor)), None)
    return None


