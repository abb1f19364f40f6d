"""Many Hugging Face architectures at once: what each keeps at a level, and what stays exact.

A sweep for ops without a rule: one small config per architecture (2 layers or stages, 128
wide, random weights, nothing downloaded), one training step of its own loss under
``compressed(level, stats=...)`` (L3 by default): the bytes autograd would keep, the bytes
kept, their ratio and what stayed exact, by op. Language models of every common family (dense
and mixture of experts), encoders, an encoder-decoder, vision transformers and convolutional
networks, semantic segmentation (the loss over per-pixel logits), masked-autoencoder
pretraining, object detection (DETR's set loss, deformable attention's sampling), speech;
dropout, drop path and the like off (so that ``--gradients`` compares two runs that differ by
rounding alone). ``--without-new-rules`` removes the rules of the grouped
matmuls of mixture-of-experts layers, the vector 2-norms and ``F.normalize`` to show the same
table as before they existed. ``--gradients`` adds the relative error of the whole gradient at
``u8`` against exact. ``--allocator`` adds the level's one-step gradient error with uniform
widths (``compressed(level)``) beside the same with the bit allocator's widths
(``compress(model, level)``, after its statistics step), mean of rounding seeds 3-5: where the
allocator's error is the larger, its noise model misjudges that architecture. ``--autocast
bf16`` runs every step under ``torch.autocast`` (float32 weights), as mixed precision training
does.

    python benchmarks/hf_zoo.py [--level L3] [--models mixtral,swinv2] [--without-new-rules]
        [--gradients] [--allocator] [--autocast bf16]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812
from rich.console import Console
from rich.table import Table

import actune

try:
    import transformers as t
except ImportError as err:
    raise SystemExit("needs Hugging Face transformers: pip install 'actune[hf]'") from err

MIB = 2**20
VOCAB = 1000
_LM = {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}
_DECODER = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256,
            "num_attention_heads": 4}
_GQA = {**_DECODER, "num_key_value_heads": 2}
_MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}
_ENCODER = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256,
            "num_attention_heads": 4, "vocab_size": VOCAB}
_VIT = {"image_size": 64, "patch_size": 8, "num_hidden_layers": 2, "hidden_size": 128,
        "intermediate_size": 256, "num_attention_heads": 4, "num_labels": 10}
_STAGES = {"hidden_sizes": [32, 64, 128, 256], "depths": [1, 1, 1, 1], "num_labels": 10}
_QUIET = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
_SWIN = {"image_size": 64, "patch_size": 4, "embed_dim": 32, "depths": [1, 1],
         "num_heads": [2, 4], "window_size": 4, "num_labels": 10, "drop_path_rate": 0.0,
         **_QUIET}

_SPEECH = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256,
           "num_attention_heads": 4, "conv_dim": (32, 32, 32), "conv_stride": (5, 2, 2),
           "conv_kernel": (10, 3, 3), "num_conv_pos_embeddings": 16,
           "num_conv_pos_embedding_groups": 4, "num_labels": 3, "vocab_size": 32,
           "hidden_dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0,
           "feat_proj_dropout": 0.0, "layerdrop": 0.0, "mask_time_prob": 0.0}


def _backbone(stages: int) -> t.ResNetConfig:
    """A small ResNet whose last ``stages`` stages feed a detector."""
    return t.ResNetConfig(hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1],
                          out_features=[f"stage{i}" for i in range(5 - stages, 5)])


_DETECTION = {"use_timm_backbone": False, "use_pretrained_backbone": False,
              "backbone_config": _backbone(1), "d_model": 64, "encoder_layers": 1,
              "decoder_layers": 1, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
              "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "num_queries": 20,
              "num_labels": 5, "dropout": 0.0}

#: name -> (input kind, a builder of the model)
ZOO: dict[str, tuple[str, Callable[[], torch.nn.Module]]] = {
    "llama": ("causal", lambda: t.LlamaForCausalLM(t.LlamaConfig(**_GQA, **_LM))),
    "mistral": ("causal", lambda: t.MistralForCausalLM(t.MistralConfig(**_GQA, **_LM))),
    "qwen3": ("causal", lambda: t.Qwen3ForCausalLM(t.Qwen3Config(**_GQA, head_dim=32, **_LM))),
    "gemma2": ("causal", lambda: t.Gemma2ForCausalLM(t.Gemma2Config(**_GQA, head_dim=32,
                                                                     **_LM))),
    "phi3": ("causal", lambda: t.Phi3ForCausalLM(t.Phi3Config(**_GQA, **_LM))),
    "gpt_neox": ("causal", lambda: t.GPTNeoXForCausalLM(t.GPTNeoXConfig(**_DECODER, **_LM))),
    "falcon": ("causal", lambda: t.FalconForCausalLM(t.FalconConfig(
        num_hidden_layers=2, hidden_size=128, num_attention_heads=4, **_LM))),
    "opt": ("causal", lambda: t.OPTForCausalLM(t.OPTConfig(
        num_hidden_layers=2, hidden_size=128, ffn_dim=256, num_attention_heads=4,
        word_embed_proj_dim=128, dropout=0.0, attention_dropout=0.0, **_LM))),
    "gptj": ("causal", lambda: t.GPTJForCausalLM(t.GPTJConfig(
        n_layer=2, n_embd=128, n_head=4, rotary_dim=16, **_LM))),
    "mixtral": ("causal", lambda: t.MixtralForCausalLM(t.MixtralConfig(**_GQA, **_MOE,
                                                                       **_LM))),
    "qwen2_moe": ("causal", lambda: t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(
        **_GQA, moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts=4,
        num_experts_per_tok=2, **_LM))),
    "olmoe": ("causal", lambda: t.OlmoeForCausalLM(t.OlmoeConfig(
        **_GQA, num_experts=4, num_experts_per_tok=2, **_LM))),
    "qwen3_moe": ("causal", lambda: t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(
        **_GQA, head_dim=32, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
        **_LM))),
    "granitemoe": ("causal", lambda: t.GraniteMoeForCausalLM(t.GraniteMoeConfig(
        **_GQA, **_MOE, **_LM))),
    "gpt_oss": ("causal", lambda: t.GptOssForCausalLM(t.GptOssConfig(
        num_hidden_layers=2, hidden_size=128, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, **_MOE, **_LM))),
    "deepseek_v3": ("causal", lambda: t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
        num_hidden_layers=2, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=32, **_LM))),
    "gemma3": ("causal", lambda: t.Gemma3ForCausalLM(t.Gemma3TextConfig(**_GQA, head_dim=32,
                                                                        **_LM))),
    "modernbert": ("masked", lambda: t.ModernBertForMaskedLM(t.ModernBertConfig(
        num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
        vocab_size=VOCAB, pad_token_id=0))),
    "roberta": ("masked", lambda: t.RobertaForMaskedLM(t.RobertaConfig(**_ENCODER,
                                                                        pad_token_id=1))),
    "deberta_v2": ("masked", lambda: t.DebertaV2ForMaskedLM(t.DebertaV2Config(
        **_ENCODER, pad_token_id=0))),
    "convbert": ("masked", lambda: t.ConvBertForMaskedLM(t.ConvBertConfig(
        **_ENCODER, embedding_size=128, **_QUIET))),
    "longformer": ("masked", lambda: t.LongformerForMaskedLM(t.LongformerConfig(
        **_ENCODER, attention_window=16, max_position_embeddings=130, **_QUIET))),
    "bart": ("seq2seq", lambda: t.BartForConditionalGeneration(t.BartConfig(
        encoder_layers=1, decoder_layers=1, d_model=128, encoder_ffn_dim=256,
        decoder_ffn_dim=256, encoder_attention_heads=4, decoder_attention_heads=4,
        vocab_size=VOCAB, pad_token_id=1, decoder_start_token_id=2, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0))),
    "vit": ("image", lambda: t.ViTForImageClassification(t.ViTConfig(**_VIT))),
    "beit": ("image", lambda: t.BeitForImageClassification(t.BeitConfig(
        **_VIT, use_relative_position_bias=True, drop_path_rate=0.0, **_QUIET))),
    "dinov2": ("image", lambda: t.Dinov2ForImageClassification(t.Dinov2Config(
        image_size=64, patch_size=8, num_hidden_layers=2, hidden_size=128,
        num_attention_heads=4, num_labels=10))),
    "swin": ("image", lambda: t.SwinForImageClassification(t.SwinConfig(**_SWIN))),
    "swinv2": ("image", lambda: t.Swinv2ForImageClassification(t.Swinv2Config(**_SWIN))),
    "convnext": ("image", lambda: t.ConvNextForImageClassification(t.ConvNextConfig(
        **_STAGES))),
    "convnextv2": ("image", lambda: t.ConvNextV2ForImageClassification(t.ConvNextV2Config(
        **_STAGES))),
    "regnet": ("image", lambda: t.RegNetForImageClassification(t.RegNetConfig(
        **_STAGES, groups_width=8))),
    "resnet": ("image", lambda: t.ResNetForImageClassification(t.ResNetConfig(**_STAGES))),
    "segformer": ("image", lambda: t.SegformerForImageClassification(t.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[32, 64],
        num_attention_heads=[1, 2], num_labels=10, decoder_hidden_size=64, drop_path_rate=0.0,
        classifier_dropout_prob=0.0, **_QUIET))),
    "levit": ("image", lambda: t.LevitForImageClassification(t.LevitConfig(
        image_size=64, hidden_sizes=[64, 96, 128], num_attention_heads=[2, 3, 4],
        depths=[2, 2, 2], key_dim=[16, 16, 16], num_labels=10))),
    "poolformer": ("image", lambda: t.PoolFormerForImageClassification(t.PoolFormerConfig(
        depths=[1, 1, 1, 1], hidden_sizes=[32, 64, 96, 128], num_labels=10))),
    # masked-autoencoder pretraining: the kept patches gathered, the masked ones restored
    "vitmae": ("masked_image", lambda: t.ViTMAEForPreTraining(t.ViTMAEConfig(
        **{k: v for k, v in _VIT.items() if k != "num_labels"}, decoder_num_hidden_layers=1,
        decoder_hidden_size=64, decoder_intermediate_size=128, decoder_num_attention_heads=4,
        **_QUIET))),
    # semantic segmentation: the loss over (N, C, H, W) logits, upsampled to the labels
    "segformer_seg": ("segmentation", lambda: t.SegformerForSemanticSegmentation(
        # (its default 4 stages: the first attends over a sequence reduced 8 x 8)
        t.SegformerConfig(depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 128], num_labels=10,
                          decoder_hidden_size=64, drop_path_rate=0.0,
                          classifier_dropout_prob=0.0, **_QUIET))),
    "mobilevit_seg": ("segmentation", lambda: t.MobileViTForSemanticSegmentation(
        t.MobileViTConfig(image_size=64, hidden_sizes=[32, 48, 64],
                          neck_hidden_sizes=[8, 16, 24, 32, 48, 64, 128], num_labels=10,
                          aspp_out_channels=32, classifier_dropout_prob=0.0,
                          aspp_dropout_prob=0.0, **_QUIET))),
    "beit_seg": ("segmentation", lambda: t.BeitForSemanticSegmentation(t.BeitConfig(
        **{**_VIT, "num_hidden_layers": 4}, out_indices=[1, 2, 3, 4],
        use_auxiliary_head=False, pool_scales=[1, 2], drop_path_rate=0.0, **_QUIET))),
    "upernet_seg": ("segmentation", lambda: t.UperNetForSemanticSegmentation(t.UperNetConfig(
        backbone_config=t.ConvNextConfig(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                                         out_features=["stage1", "stage2", "stage3",
                                                       "stage4"]),
        hidden_size=32, use_auxiliary_head=False, num_labels=10, pool_scales=[1, 2]))),
    # object detection: a set loss over matched boxes (scipy's Hungarian matcher)
    "detr": ("detection", lambda: t.DetrForObjectDetection(t.DetrConfig(**_DETECTION))),
    # deformable attention samples its values with F.grid_sample (two-stage: transformers
    # 5.25 cannot tie the box heads of the one-stage configuration)
    "deformable_detr": ("detection", lambda: t.DeformableDetrForObjectDetection(
        t.DeformableDetrConfig(**{**_DETECTION, "backbone_config": _backbone(3)},
                               num_feature_levels=3, with_box_refine=True, two_stage=True,
                               two_stage_num_proposals=20))),
    "wav2vec2": ("audio", lambda: t.Wav2Vec2ForSequenceClassification(t.Wav2Vec2Config(
        **_SPEECH))),
    # attention through F.multi_head_attention_forward, its gated position bias as the mask
    "wavlm": ("audio", lambda: t.WavLMForSequenceClassification(t.WavLMConfig(**_SPEECH))),
}


def loss_of(kind: str, model: torch.nn.Module) -> Callable[[], torch.Tensor]:
    """A training step's loss for an input of ``kind`` (batch 4, fixed random values)."""
    gen = torch.Generator().manual_seed(0)
    if kind in ("causal", "masked", "seq2seq"):
        ids = torch.randint(3, VOCAB, (4, 64), generator=gen)
        return lambda: model(input_ids=ids, labels=ids).loss
    if kind in ("image", "segmentation"):
        pixels = torch.randn(4, 3, 64, 64, generator=gen)
        shape = (4,) if kind == "image" else (4, 64, 64)  # a class a pixel
        labels = torch.randint(0, 10, shape, generator=gen)
        if kind == "segmentation":
            labels[:, :4] = 255  # a border left unlabelled, as datasets do
        return lambda: model(pixel_values=pixels, labels=labels).loss
    if kind == "masked_image":  # (the masking's noise given: the same patches every step)
        pixels = torch.randn(4, 3, 64, 64, generator=gen)
        noise = torch.rand(4, (64 // 8) ** 2, generator=gen)
        return lambda: model(pixel_values=pixels, noise=noise).loss
    if kind == "detection":  # three boxes an image
        pixels = torch.randn(4, 3, 64, 64, generator=gen)
        boxes = [{"class_labels": torch.randint(0, 5, (3,), generator=gen),
                  "boxes": torch.rand(3, 4, generator=gen) * 0.5 + 0.25} for _ in range(4)]
        return lambda: model(pixel_values=pixels, labels=boxes).loss
    values = torch.randn(4, 4000, generator=gen)
    labels = torch.randint(0, 3, (4,), generator=gen)
    return lambda: model(input_values=values, labels=labels).loss


def _quiet(model: torch.nn.Module) -> None:
    """Every dropout module off (the configs turn off what modules do not hold: functional
    dropout, drop path, layer drop, SpecAugment masks)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def _built(name: str) -> tuple[str, torch.nn.Module]:
    """The zoo's ``name``: its input kind and the model, seeded, training, dropout off."""
    kind, build = ZOO[name]
    torch.manual_seed(0)
    model = build()
    model.train()
    _quiet(model)
    return kind, model


#: ``--autocast``: the dtype the steps run under ``torch.autocast`` in (None: float32).
AUTOCAST: list[torch.dtype | None] = [None]


def _autocast() -> contextlib.AbstractContextManager:
    dtype = AUTOCAST[0]
    return torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()


def _gradient(model: torch.nn.Module, loss: Callable[[], torch.Tensor], seed: int,
              level: str | None = None, stats=None) -> torch.Tensor:
    """The whole gradient of one step, under ``compressed(level, stats=stats)`` if a level is
    given (and autocast, with ``--autocast``)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with (actune.compressed(level, stats=stats) if level else contextlib.nullcontext(),
          _autocast()):
        value = loss()
    value.float().backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def allocator_errors(name: str, level: str) -> tuple[float, float, float]:
    """One-step gradient error against exact at ``level``: uniform widths, the bit
    allocator's statistics step, then its allocated widths (a converted copy, after its
    statistics step; seeds 3-5, mean)."""
    kind, model = _built(name)
    exact = _gradient(model, loss_of(kind, model), 1)

    def error(m: torch.nn.Module, lv: str | None) -> float:
        loss = loss_of(kind, m)
        return statistics.mean(((_gradient(m, loss, seed, lv) - exact).norm()
                                / exact.norm()).item() for seed in (3, 4, 5))

    uniform = error(model, level)
    converted = actune.compress(copy.deepcopy(model), level)
    # the statistics step, then the first step at the allocated widths
    first = _gradient(converted, loss_of(kind, converted), 1)
    _gradient(converted, loss_of(kind, converted), 2)
    actune.autoprec_of(converted).every = 0  # (no further statistics step among the seeds)
    return uniform, ((first - exact).norm() / exact.norm()).item(), error(converted, None)


def measure(name: str, level: str, gradients: bool) -> dict:
    kind, model = _built(name)
    loss = loss_of(kind, model)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def step(lv: str, stats=None, seed: int = 1) -> torch.Tensor:
        model.load_state_dict(state)
        return _gradient(model, loss, seed, lv, stats)

    found: list = []
    step(level, found.append)
    s = found[0]
    out = {"saved": s.saved_bytes, "kept": s.kept_bytes, "ratio": s.ratio,
           "exact": s.describe_exact() if s.exact else "nothing"}
    if gradients:
        exact = step("L0")
        out["u8"] = ((step("u8") - exact).norm() / exact.norm()).item()
    return out


@contextlib.contextmanager
def without_new_rules():
    """The rules of grouped matmuls, vector 2-norms and F.normalize removed."""
    from actune.rules import RULES
    from actune.rules.matmuls import GROUPED_MATMULS
    from actune.rules.norms import VECTOR_NORMS

    removed = {f: RULES.pop(f) for f in (*GROUPED_MATMULS, *VECTOR_NORMS, F.normalize)}
    try:
        yield
    finally:
        RULES.update(removed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--level", default="L3")
    parser.add_argument("--models", default=None, help="comma-separated names (default: all)")
    parser.add_argument("--without-new-rules", action="store_true")
    parser.add_argument("--gradients", action="store_true")
    parser.add_argument("--allocator", action="store_true",
                        help="one-step gradient error, uniform widths and the allocator's")
    parser.add_argument("--autocast", choices=("bf16", "fp16"), default=None,
                        help="run every step under torch.autocast in this dtype")
    args = parser.parse_args()
    AUTOCAST[0] = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.autocast]
    names = list(ZOO) if args.models is None else args.models.split(",")
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; choose from {', '.join(ZOO)}")
    table = Table(title=f"{args.level}, one training step, batch 4"
                  + (f", autocast {args.autocast}" if args.autocast else "")
                  + (" (grouped matmul, vector norm, normalize rules removed)"
                     if args.without_new_rules else ""))
    extra = (*(("u8 grad error",) if args.gradients else ()),
             *((f"{args.level} uniform", "statistics step", f"{args.level} allocated",
                "allocated / uniform") if args.allocator else ()))
    for col in ("model", "saved MiB", "kept MiB", "ratio", *extra, "kept exact"):
        table.add_column(col, justify="left" if col in ("model", "kept exact") else "right")
    warnings.filterwarnings("ignore")
    t.logging.set_verbosity_error()
    with without_new_rules() if args.without_new_rules else contextlib.nullcontext():
        for name in names:
            r = measure(name, args.level, args.gradients)
            cells = [f"{r['u8']:.2%}"] if args.gradients else []
            if args.allocator:
                uniform, first, allocated = allocator_errors(name, args.level)
                cells += [f"{uniform:.1%}", f"{first:.1%}", f"{allocated:.1%}",
                          f"{allocated / uniform:.2f}x"]
            table.add_row(name, f"{r['saved'] / MIB:.2f}", f"{r['kept'] / MIB:.3f}",
                          f"{r['ratio']:.1f}x", *cells, r["exact"])
    Console(width=170).print(table)


if __name__ == "__main__":
    main()
