"""`patch_causal_lm`: a transformers causal LM whose loss never materialises its logits.

The patched model's ``forward`` runs the decoder as before, then, when labels are given,
takes the loss straight from the last hidden states and the head's weight through the fused
linear + cross-entropy (`ops/cross_entropy/`): the ``tokens x vocab`` logits and their
gradient never exist, and ``outputs.logits`` is None. Without labels (generation,
evaluation without a loss) the original forward runs unchanged.

With a `Lomo` attached (untied, unsharded weights, eager backward) the two ``vocab x
hidden`` gradients go too: the head is stepped from each vocabulary chunk's gradient as the
loss's backward produces it (`ops/cross_entropy/head_gradient.py`), and the input
embedding, looked up through `ops.embedding.embedding_rows`, from the rows the batch used
(`optim/row_blocks.py`). Any other optimizer gets both gradients as usual.

Only architectures whose loss is exactly "bias-free linear head, then transformers'
causal-LM cross-entropy" are patched; others are refused by name rather than given a
different loss.

Called with ``fused_lm_head=True`` and labels (as TRL's trainers call a model given their own
fused head), the patched forward returns per-token results instead of a mean loss
(`TokenOutputs`): the log-probability of each label (through the fused loss, so
differentiable, and the head stepped from its chunks as above), the label mask, and, without
gradient, the statistics TRL asks for (each token's entropy, whether its label is the most
likely token, ``log(sum p^2)``, the mean logit: `token_metrics.py`), all at the temperature
`set_fused_head` gave the model (1 unless told; divided inside the kernels' blocks). TRL's
trainers then keep this head: patched after the trainer is built, the patched forward
replaces TRL's; patched before, `lomo_kernels.enable_trl()` makes the trainer keep it and
records the temperature and statistics it asks for (`trl_sft.py`). Anything else that wraps
or replaces the patched forward so that the head's logits are formed the ordinary way is
refused by Lomo/AdaLomo at the step, before any change (`optim/head_guard.py`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ..ops.cross_entropy import causal_lm_loss, linear_cross_entropy
from ..ops.embedding import embedding_rows
from ..optim import head_guard
from .token_metrics import STATISTICS, token_statistics

# Classes whose forward is "decoder -> lm_head -> ForCausalLMLoss" with nothing in between.
SUPPORTED_CLASSES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# Config options that change the logits between the head and the loss.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")
_PATCHED = head_guard.PATCHED_ATTRIBUTE
# The forward the model had before it was patched (run without labels).
_UNPATCHED_FORWARD = "_lomo_kernels_unpatched_forward"
# Whether that forward was set on the instance (a wrapper's, e.g. TRL's): unpatching restores
# it then, else the class's forward.
_INSTANCE_FORWARD = "_lomo_kernels_instance_forward"
# (temperature, statistics) the patched forward's fused_lm_head=True answers with.
_FUSED_HEAD = "_lomo_kernels_fused_head_request"
DEFAULT_FUSED_HEAD = (1.0, ("entropy", "is_top1"))
IGNORE_INDEX = -100


def set_fused_head(
    model: torch.nn.Module, temperature: float = 1.0, outputs: tuple[str, ...] = ("log_probs",)
) -> None:
    """What ``model(..., labels=..., fused_lm_head=True)`` computes, as TRL's
    ``add_fused_lm_head(model, temperature, outputs=...)`` asks: log-probabilities of the
    labels under ``softmax(logits / temperature)``, and the per-token `outputs` among
    ``log_probs`` and `token_metrics.STATISTICS` (the others are None). Refuses, by name,
    a field it does not compute and a temperature that is not a finite positive number."""
    unknown = [name for name in outputs if name != "log_probs" and name not in STATISTICS]
    if unknown:
        raise ValueError(
            f"lomo_kernels.patch_causal_lm: the fused head does not compute {', '.join(unknown)} "
            f"(it gives log_probs, {', '.join(STATISTICS)}); train this model with TRL's own "
            "head: lomo_kernels.unpatch_causal_lm(model) before building the trainer"
        )
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"lomo_kernels: temperature must be a number, got {temperature!r}")
    if not 0 < temperature < float("inf"):
        raise ValueError(f"lomo_kernels: temperature must be finite and > 0, got {temperature}")
    fields = tuple(name for name in STATISTICS if name in outputs)
    setattr(model, _FUSED_HEAD, (float(temperature), fields))


def _refusal(model: torch.nn.Module) -> str:
    name = type(model).__name__
    if name not in SUPPORTED_CLASSES:
        return (
            f"{name} is not one of the architectures the fused head reproduces exactly "
            f"({', '.join(SUPPORTED_CLASSES)}); train it unpatched"
        )
    for option in LOGIT_TRANSFORMS:
        if getattr(model.config, option, None):
            return f"{name} sets config.{option}, which the fused head does not apply"
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return f"{name}'s output head is not a bias-free nn.Linear ({type(head).__name__})"
    loss_type = getattr(model.config, "loss_type", None)
    if loss_type not in (None, "ForCausalLM"):
        return f"{name} uses loss_type={loss_type!r}, not transformers' causal-LM loss"
    return ""


def patch_causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """Makes ``model(input_ids=..., labels=...).loss`` logits-free (see the module docstring);
    returns the model. Refuses, naming the reason, an architecture or option it does not
    reproduce exactly. Idempotent, and patches again a head or input embedding replaced
    since (``resize_token_embeddings``); `unpatch_causal_lm` undoes it.

    The forwards are module-level functions partially applied to the model, its head and
    its embedding, so a deep copy (or a pickled and loaded copy) of the patched model
    computes its loss from its own weights."""
    reason = _refusal(model)
    if reason:
        raise ValueError(f"lomo_kernels.patch_causal_lm: {reason}")
    if not getattr(model, _PATCHED, False):
        setattr(model, _UNPATCHED_FORWARD, model.forward)
        setattr(model, _INSTANCE_FORWARD, "forward" in vars(model))
        model.forward = functools.partial(_forward, model)
        setattr(model, _PATCHED, True)
    head_guard.register(model)
    head = model.get_output_embeddings()
    if not _patched_with(head, _head_forward):
        head.forward = functools.partial(_head_forward, head)
    embedding = model.get_input_embeddings()
    if _plain_embedding(embedding) and not _patched_with(embedding, _embedding_forward):
        embedding.forward = functools.partial(_embedding_forward, embedding)
    return model


def _patched_with(module: torch.nn.Module, function: Any) -> bool:
    """Whether `module`'s forward is `function` applied to it."""
    forward = vars(module).get("forward")
    return (
        isinstance(forward, functools.partial)
        and forward.func is function
        and forward.args == (module,)
    )


def _forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    past_key_values: Any = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    use_cache: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    fused_lm_head: bool = False,
    **kwargs: Any,
) -> Any:
    """The patched model's forward (applied to it)."""
    # Only what the caller gave: transformers warns about some arguments even when None.
    given = {
        key: value
        for key, value in (
            ("input_ids", input_ids),
            ("attention_mask", attention_mask),
            ("position_ids", position_ids),
            ("past_key_values", past_key_values),
            ("inputs_embeds", inputs_embeds),
            ("use_cache", use_cache),
        )
        if value is not None
    }
    if labels is None and kwargs.get("shift_labels") is None:
        if fused_lm_head:
            raise ValueError(
                "lomo_kernels.patch_causal_lm: fused_lm_head=True returns per-token "
                "log-probabilities of labels: pass labels= (or shift_labels=)"
            )
        if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            given["logits_to_keep"] = logits_to_keep
        if torch.compiler.is_compiling():  # nothing to tag in a traced graph
            return getattr(model, _UNPATCHED_FORWARD)(**given, **kwargs)
        with head_guard.logits_requested():  # the logits are what the caller asked for
            return getattr(model, _UNPATCHED_FORWARD)(**given, **kwargs)
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        raise ValueError(
            "lomo_kernels.patch_causal_lm: logits_to_keep with labels is not supported "
            "(the loss covers every position); call without logits_to_keep"
        )
    head = model.get_output_embeddings()
    if not _patched_with(head, _head_forward):
        raise ValueError(
            "lomo_kernels.patch_causal_lm: the model's output head was replaced after it was "
            "patched (resize_token_embeddings and set_output_embeddings do that), so the loss "
            "would not be the patched one; call lomo_kernels.patch_causal_lm(model) again"
        )
    if not torch.compiler.is_compiling():
        head_guard.register(model)  # a copy (deepcopy, pickle) of a patched model too
    return_dict = kwargs.pop("return_dict", None)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    outputs = model.model(**given, **kwargs)
    # Through the head module's call, so that sharding engines' module hooks (ZeRO-3's
    # gather, FSDP's unshard) see the head used, in forward and in backward.
    if fused_lm_head:
        temperature, fields = getattr(model, _FUSED_HEAD, DEFAULT_FUSED_HEAD)
        per_token = dict(temperature=temperature, fields=fields)
        result = _token_outputs(head, outputs, labels, shift_labels, num_items_in_batch, per_token)
    else:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        loss = head(
            outputs.last_hidden_state,
            loss_labels=labels,
            num_items_in_batch=num_items_in_batch,
            shift_labels=shift_labels,
        )
        result = CausalLMOutputWithPast(
            loss=loss,
            logits=None,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
    return result.to_tuple() if return_dict is False else result


def _token_outputs(
    head: torch.nn.Module,
    outputs: Any,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    num_items_in_batch: torch.Tensor | int | None,
    per_token: dict[str, Any],
) -> Any:
    """`fused_lm_head=True`: per-token results, for positions ``[:, :-1]`` against
    ``labels[:, 1:]`` (every position against ``shift_labels`` when given), as TRL's trainers
    read them; `per_token`: the temperature and statistics asked for."""
    token_loss, stats, mask = head(
        outputs.last_hidden_state,
        loss_labels=labels,
        shift_labels=shift_labels,
        per_token=per_token,
    )
    if shift_labels is None:  # the last position predicts nothing
        token_loss, mask = token_loss[:, :-1], mask[:, :-1]
        stats = {name: value[:, :-1] for name, value in stats.items()}
    log_probs = -token_loss  # 0 where the label is ignored
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    if torch.is_tensor(count):
        count = count.to(log_probs.device)
    return token_outputs_class()(
        loss=-log_probs.sum() / count,
        log_probs=log_probs,
        label_mask=mask,
        **stats,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )


@functools.cache
def token_outputs_class() -> type:
    """`TokenOutputs`, a transformers ModelOutput (built on first use, so that importing this
    module does not import transformers)."""
    from transformers.utils import ModelOutput

    @dataclass
    class TokenOutputs(ModelOutput):
        """The patched forward's result with ``fused_lm_head=True`` (field names as TRL's
        trainers read them). Per position: ``log_probs`` (of the label; 0 where ignored;
        differentiable, through the fused loss), the statistics asked for (`set_fused_head`;
        no gradient; 0 / False where ignored; None when not asked for), ``label_mask``.
        ``loss``: ``-log_probs.sum()`` over ``num_items_in_batch``, or over the counted
        tokens. TRL's MoE ``aux_loss`` is not computed (no architecture patched has one)."""

        loss: torch.Tensor | None = None
        log_probs: torch.Tensor | None = None
        entropy: torch.Tensor | None = None
        log_sum_sq_probs: torch.Tensor | None = None
        mean_logits: torch.Tensor | None = None
        is_top1: torch.Tensor | None = None
        label_mask: torch.Tensor | None = None
        hidden_states: Any = None
        attentions: Any = None

        def __getattr__(self, name: str) -> Any:
            if name in NOT_COMPUTED:
                raise AttributeError(
                    f"lomo_kernels.patch_causal_lm: the fused head does not compute {name} "
                    f"(it gives {', '.join(COMPUTED)}); train this model with TRL's own head: "
                    "lomo_kernels.unpatch_causal_lm(model) before building the trainer"
                )
            raise AttributeError(name)

    return TokenOutputs


COMPUTED = ("loss", "log_probs", *STATISTICS, "label_mask")
NOT_COMPUTED = ("aux_loss",)


def _head_forward(
    head: torch.nn.Linear,
    hidden_states: torch.Tensor,
    loss_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,
    per_token: dict[str, Any] | None = None,
) -> Any:
    """The head's forward (applied to it): logits as before, or, given ``loss_labels`` or
    ``shift_labels``, the fused causal-LM loss of its input; with ``per_token`` (a
    temperature and the statistics' names), per position (every one, the last included,
    against the shifted labels): the fp32 loss (the negated log-probability of the label),
    the statistics (`token_statistics`), and whether the label counts."""
    if loss_labels is None and shift_labels is None:
        logits = torch.nn.functional.linear(hidden_states, head.weight)
        return head_guard.tag_requested_logits(logits)
    if per_token:
        if shift_labels is None:
            padded = torch.nn.functional.pad(loss_labels, (0, 1), value=IGNORE_INDEX)
            shift_labels = padded[..., 1:]
        shift_labels = shift_labels.to(hidden_states.device)
        temperature = per_token["temperature"]
        token_loss = linear_cross_entropy(
            hidden_states,
            head.weight,
            shift_labels,
            ignore_index=IGNORE_INDEX,
            reduction="none",
            temperature=temperature,
        )
        stats = token_statistics(
            hidden_states,
            head.weight,
            shift_labels,
            IGNORE_INDEX,
            temperature=temperature,
            fields=per_token["fields"],
        )
        return token_loss, stats, shift_labels != IGNORE_INDEX
    return causal_lm_loss(
        hidden_states,
        head.weight,
        loss_labels,
        num_items_in_batch=num_items_in_batch,
        shift_labels=shift_labels,
    )


def _plain_embedding(embedding: torch.nn.Module) -> bool:
    """An nn.Embedding whose lookup is F.embedding(ids, weight, padding_idx) alone."""
    return (
        type(embedding) is torch.nn.Embedding
        and embedding.max_norm is None
        and not embedding.scale_grad_by_freq
        and not embedding.sparse
    )


def _embedding_forward(embedding: torch.nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """The input embedding's forward (applied to it): `embedding_rows` (its backward hands a
    Lomo stepping the weight only the used rows), except while tracing for torch.compile,
    where the plain lookup keeps the compiled paths' handling of the embedding's gradient."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return torch.nn.functional.embedding(ids, embedding.weight, embedding.padding_idx)
    return embedding_rows(ids, embedding.weight, embedding.padding_idx)


def unpatch_causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """Restores the classes' forwards on a model `patch_causal_lm` patched."""
    if getattr(model, _PATCHED, False):
        if getattr(model, _INSTANCE_FORWARD, False):  # a wrapper's, as it was
            model.forward = getattr(model, _UNPATCHED_FORWARD)
        else:
            del model.forward
        delattr(model, _UNPATCHED_FORWARD)
        if hasattr(model, _INSTANCE_FORWARD):
            delattr(model, _INSTANCE_FORWARD)
        delattr(model, _PATCHED)
        if hasattr(model, _FUSED_HEAD):
            delattr(model, _FUSED_HEAD)
        head_guard.unregister(model)
        for module, function in (
            (model.get_output_embeddings(), _head_forward),
            (model.get_input_embeddings(), _embedding_forward),
        ):
            if _patched_with(module, function):
                del module.forward
    return model
