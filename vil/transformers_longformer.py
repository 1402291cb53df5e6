"""Hugging Face transformers' Longformer models on this project's sliding-window op: :func:`accelerate_longformer`.

transformers' ``LongformerSelfAttention`` (in ``LongformerModel`` and every ``LongformerFor*`` head) and
``LEDEncoderSelfAttention`` (the encoder of ``LEDModel`` and ``LEDForConditionalGeneration``; LED's decoder is full
attention and stays) compute what :class:`vil.models.longformer.LongformerSelfAttention` computes: a sliding window
of ``attention_window // 2`` keys on each side, from which padding and global tokens are removed, the global tokens'
keys for every token, and full attention with the ``*_global`` projections for the global tokens. The conversion
changes the class of each such module in place (same parameters, same names, same state dict); the model calls the
op through ``vil.models.longformer.SlidingWindowSelfAttention.attend``. transformers is imported only here
(``pip install vil[transformers]``).

From transformers 5 on, ``LongformerModel`` also builds a (batch, 1, L, L) float mask, keeps its first query row and
drops the rest: at 16k tokens 1 GiB and half a second on a CPU for a (batch, L) result. An accelerated
``LongformerModel`` builds that mask through :data:`MASK_IMPLEMENTATION` instead, which gives the same values as a
broadcast view of that row. (transformers 4 builds the row alone.) LED's encoder forms such a mask in every version;
this module replaces the function of transformers' LED module that forms it with :func:`led_padding_mask`, the same
values as a view.
"""

import logging

import torch
from transformers import AttentionInterface, masking_utils
from transformers.models.led import modeling_led
from transformers.models.led.modeling_led import LEDEncoderSelfAttention
from transformers.models.longformer import modeling_longformer
from transformers.models.longformer.modeling_longformer import LongformerModel, LongformerSelfAttention

from .models.longformer import SlidingWindowSelfAttention
from .ops import check_backend_1d

_log = logging.getLogger(__name__)


class _Accelerated(SlidingWindowSelfAttention):
    """The forward of transformers' layer (its arguments, its tuple of outputs) on the op. Two things the op has no
    place for run transformers' own forward instead, said once each: attention dropout in training, and
    ``output_attentions``, whose probabilities the op never forms. ``layer_head_mask`` (transformers 4, which passes
    it by name) scales each head's output, as it scales the head's probabilities there."""

    dilation, causal = 1, False
    _said = set()  # the reasons for running transformers' own attention already logged

    @property
    def window(self):
        return self.one_sided_attn_window_size

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        is_index_masked=None,
        is_index_global_attn=None,
        is_global_attn=None,
        output_attentions=False,
        *,
        layer_head_mask=None,
    ):
        reasons = []
        if output_attentions:
            reasons.append(
                "output_attentions=True asks for the attention probabilities, which the op never forms: the "
                "accelerated layers run transformers' own attention in such calls."
            )
        if self.training and self.dropout > 0:
            reasons.append(
                "The attention dropout is above 0: in training the accelerated layers run transformers' own "
                "attention, which applies it. To train on the op, set each layer's dropout to 0 (layer.dropout = 0.0 "
                "on the self-attention modules: the config's attention_probs_dropout_prob, attention_dropout for LED, "
                "is read only when the model is built)."
            )
        for reason in reasons:
            if reason not in _Accelerated._said:
                _Accelerated._said.add(reason)
                _log.warning("%s", reason)
        if reasons:
            head_mask = {} if layer_head_mask is None else {"layer_head_mask": layer_head_mask}
            # Eagerly under torch.compile: dynamo fails on its global attention (it branches on a tensor's truth).
            attention = super().forward if torch.compiler.is_exporting() else torch.compiler.disable(super().forward)
            return attention(
                hidden_states,
                attention_mask=attention_mask,
                is_index_masked=is_index_masked,
                is_index_global_attn=is_index_global_attn,
                is_global_attn=is_global_attn,
                output_attentions=output_attentions,
                **head_mask,
            )
        out = self.attend(hidden_states, is_index_masked, is_index_global_attn)
        if layer_head_mask is not None:
            if tuple(layer_head_mask.shape) != (self.num_heads,):
                raise ValueError(
                    f"head_mask gives this layer a layer_head_mask of shape {tuple(layer_head_mask.shape)}; it takes "
                    f"one value per head, ({self.num_heads},), so head_mask is (layers, {self.num_heads})."
                )
            scale = layer_head_mask.to(out.dtype)[:, None]  # any dtype, as transformers casts the product back
            out = (out.unflatten(-1, (self.num_heads, self.head_dim)) * scale).flatten(-2)
        return (out,)


class AcceleratedLongformerSelfAttention(_Accelerated, LongformerSelfAttention):
    """transformers' ``LongformerSelfAttention`` on ``local_attention_1d``."""


class AcceleratedLEDEncoderSelfAttention(_Accelerated, LEDEncoderSelfAttention):
    """transformers' ``LEDEncoderSelfAttention`` on ``local_attention_1d``."""


def key_padding_mask(batch_size, q_length, kv_length, attention_mask=None, dtype=torch.float32, **options):
    """transformers' eager attention mask (``options``: the rest of ``eager_mask``'s keywords). The one a Longformer
    model asks for (bidirectional, a padded batch, no offsets, always formed) comes as a view of one row per sequence
    expanded over the queries: 0 where a key is a token, the dtype's lowest value where it is padding. Every other
    mask is transformers' own ``eager_mask``."""
    keys_only = (
        options.get("mask_function") is masking_utils.bidirectional_mask_function
        and not options.get("q_offset")
        and not options.get("kv_offset")
        and not options.get("allow_is_bidirectional_skip")
        and (attention_mask is None or tuple(attention_mask.shape) == (batch_size, kv_length))
    )
    if not keys_only:
        return masking_utils.eager_mask(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, attention_mask=attention_mask,
            dtype=dtype, **options,
        )  # fmt: skip
    device = options.get("device", "cpu")
    if attention_mask is None:
        attention_mask = torch.ones(batch_size, kv_length, dtype=torch.bool, device=device)
    row = torch.where(attention_mask.bool(), torch.zeros((), dtype=dtype, device=device), torch.finfo(dtype).min)
    return row[:, None, None, :].expand(batch_size, 1, q_length, kv_length)


def no_attention(module, *args, **kwargs):
    """The attention function of :data:`MASK_IMPLEMENTATION`, which transformers asks every attention implementation
    for: a Longformer model never calls it (its self-attention is its own), any other model is told so."""
    raise ValueError(
        f"attn_implementation {MASK_IMPLEMENTATION!r} only builds the attention mask of Longformer models and "
        f"computes no attention; give {type(module).__name__}'s model another one, such as 'sdpa' or 'eager'."
    )


def led_padding_mask(mask, dtype, tgt_len=None):
    """transformers' ``modeling_led._prepare_4d_attention_mask_inverted``: from LED's (batch, L) mask of 0 (padding),
    1 (a token) and 2 (a global token), the dtype's lowest value, 0 and its highest, as a view of one row per
    sequence expanded over ``tgt_len`` queries (default L). transformers forms the whole (batch, 1, tgt_len, L)
    tensor, of which LED's encoder keeps one row: at 16k tokens 2.2 s and a peak of 5.7 GiB on a 2-core CPU."""
    inverted = 1.0 - mask[:, None, None, :].to(dtype)
    row = inverted.masked_fill(inverted.bool(), torch.finfo(dtype).min) * inverted
    batch, length = mask.shape
    return row.expand(batch, 1, length if tgt_len is None else tgt_len, length)


# The attention implementation of an accelerated LongformerModel, registered as transformers registers its own, so
# that every model built from its config passes transformers' checks and builds the same mask. Only where
# LongformerModel builds its mask with transformers' masking utilities (transformers 5).
MASK_IMPLEMENTATION = "vil_key_padding"
REPLACES_MASK = hasattr(modeling_longformer, "create_bidirectional_mask")
if REPLACES_MASK:
    AttentionInterface.register(MASK_IMPLEMENTATION, no_attention)
    masking_utils.AttentionMaskInterface.register(MASK_IMPLEMENTATION, key_padding_mask)

# LED's encoder forms its padding mask with this function of transformers' module, which no setting reaches. Importing
# this module (which vil.accelerate_longformer and unpickling an accelerated model do) replaces it there, for every
# LED model of the process: the values are the same.
if hasattr(modeling_led, "_prepare_4d_attention_mask_inverted"):
    modeling_led._prepare_4d_attention_mask_inverted = led_padding_mask

CONVERSIONS = {
    LongformerSelfAttention: AcceleratedLongformerSelfAttention,
    LEDEncoderSelfAttention: AcceleratedLEDEncoderSelfAttention,
}


def _say_unaccelerated(model, layers):
    """Log the Longformer self-attention layers of ``model`` that still compute transformers' attention after the
    conversion of ``layers``: subclasses of transformers' classes, left as they are, and converted layers whose
    ``forward`` is set on the instance (as wrappers such as accelerate's hooks do), which calls transformers'."""
    subclassed = [
        type(m).__name__
        for m in model.modules()
        if isinstance(m, tuple(CONVERSIONS)) and not isinstance(m, _Accelerated) and type(m) not in CONVERSIONS
    ]
    if subclassed:
        _log.warning(
            "%d of the model's %d Longformer self-attention layers (%s) subclass transformers' classes, whose "
            "forward they may change: they stay as they are and compute transformers' attention, not the op.",
            len(subclassed),
            len(subclassed) + len(layers),
            ", ".join(sorted(set(subclassed))),
        )
    wrapped = sum("forward" in vars(m) for m in layers)
    if wrapped:
        _log.warning(
            "%d of the %d accelerated self-attention layers have a forward set on the instance (as wrappers such "
            "as accelerate's hooks do), which calls transformers' attention: those layers compute it, not the op. "
            "Call vil.accelerate_longformer before wrapping the model.",
            wrapped,
            len(layers),
        )


def accelerate_longformer(model, backend=None):
    """Every Longformer-style self-attention of the transformers model ``model`` computed by
    ``vil.ops.local_attention_1d`` (``backend``: the op's backend, None for its default), in place; returns the
    model. Parameters, their names and the state dict stay as they are, so checkpoints load before or after and
    ``save_pretrained`` writes what transformers reads; a ``LongformerModel``'s ``config._attn_implementation``
    becomes :data:`MASK_IMPLEMENTATION` (not saved) where transformers builds its mask in L x L (transformers 5).
    Raises ``ValueError`` where ``model`` is not a module, has no such layer (subclasses of transformers' layers
    included: they may change its forward) or ``backend`` cannot compute its layers' 1D windows; layers left computing
    transformers' attention beside converted ones are logged (:func:`_say_unaccelerated`)."""
    if not isinstance(model, torch.nn.Module):
        kind = f"the class {model.__name__}" if isinstance(model, type) else f"a {type(model).__name__}"
        raise ValueError(
            f"vil.accelerate_longformer takes a transformers model instance (e.g. "
            f"LongformerModel.from_pretrained(path)), got {kind}."
        )
    layers = [m for m in model.modules() if type(m) in CONVERSIONS or isinstance(m, _Accelerated)]
    if not layers:
        for module in model.modules():
            base = next((c for c in CONVERSIONS if isinstance(module, c)), None)
            if base is not None:
                raise ValueError(
                    f"{type(module).__name__} subclasses transformers' {base.__name__}, whose forward it may "
                    "change; vil.accelerate_longformer converts only transformers' own classes."
                )
        raise ValueError(
            f"{type(model).__name__} has no Longformer self-attention layer to accelerate; "
            "vil.accelerate_longformer takes transformers' Longformer and LED models."
        )
    for module in layers:
        check_backend_1d(backend, module.num_heads, module.head_dim, module.one_sided_attn_window_size)
    # Only after the refusals: a refused call leaves the model as it was.
    for module in layers:
        module.__class__ = CONVERSIONS.get(type(module), type(module))
        module.backend = backend
    _say_unaccelerated(model, layers)
    for module in model.modules():
        if REPLACES_MASK and isinstance(module, LongformerModel):
            module.config._attn_implementation = MASK_IMPLEMENTATION
    return model
