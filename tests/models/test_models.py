from __future__ import annotations

import json

import pytest
import torch

from scaletrain.cli import main as cli_main
from scaletrain.models.args import PRESETS, ModelArgs, count_params, get_preset
from scaletrain.models.transformer import Transformer, build_model

# Parameter counts of the published Hugging Face checkpoints.
PUBLISHED = {
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "llama2-7b": 6_738_415_616,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
}
# intermediate_size in the published configs
FFN = {"llama3.2-1b": 8192, "llama3.2-3b": 8192, "llama2-7b": 11008, "llama3-8b": 14336,
       "llama3-70b": 28672, "llama3.1-405b": 53248}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_param_counts(name: str) -> None:
    assert count_params(get_preset(name)).total == PUBLISHED[name]
    if name in FFN:
        assert get_preset(name).hidden_dim == FFN[name]


@pytest.mark.parametrize("name", ["debug", "gpt2"])
def test_count_matches_built_model(name: str) -> None:
    args = get_preset(name)
    if name == "gpt2":
        args = args.replace(n_layers=2)
    with torch.device("meta"):
        model = Transformer(args)
    unique = {id(p): p.numel() for p in model.parameters()}
    assert sum(unique.values()) == count_params(args).total


def test_meta_build_initializes_everything(tiny_args: ModelArgs) -> None:
    model = build_model(tiny_args.replace(tie_embeddings=True), seed=1)
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    assert model.output.weight is model.tok_embeddings.weight
    # The residual projections are scaled down by depth.
    assert model.layers["0"].attention.wo.weight.std() < model.layers["0"].attention.wq.weight.std()
    again = build_model(tiny_args.replace(tie_embeddings=True), seed=1)
    assert torch.equal(model.layers["1"].feed_forward.w1.weight,
                       again.layers["1"].feed_forward.w1.weight)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_kv_cache_matches_full_forward(tiny_args: ModelArgs, arch: str) -> None:
    args = tiny_args.replace(arch=arch)
    model = build_model(args).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 20))
    with torch.no_grad():
        full = model(tokens)
        model.setup_cache(batch=2, max_len=32)
        parts = [model(tokens[:, :12])]
        for i in range(12, 20):
            parts.append(model(tokens[:, i : i + 1], start_pos=i))
        model.clear_cache()
    assert (torch.cat(parts, dim=1) - full).abs().max() < 1e-5


def test_causality(tiny_args: ModelArgs) -> None:
    model = build_model(tiny_args).eval()
    a = torch.randint(0, 128, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 128
    with torch.no_grad():
        assert torch.equal(model(a)[0, :10], model(b)[0, :10])


def test_invalid_dimensions_are_explained() -> None:
    with pytest.raises(ValueError, match="divisible by n_kv_heads"):
        ModelArgs(dim=64, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="divisible by n_heads"):
        ModelArgs(dim=65, n_heads=4)
    with pytest.raises(KeyError, match="Did you mean 'llama3-8b'"):
        get_preset("llama3-8")


def test_models_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by_name = {r["name"]: r for r in rows}
    assert set(by_name) == set(PRESETS)
    assert by_name["llama2-7b"]["params"] == 6_738_415_616
    assert by_name["llama3-8b"]["params"] == 8_030_261_248


def test_models_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["models"]) == 0
    assert "8,030,261,248" in capsys.readouterr().out


def test_init_values_stream_the_seeded_model_one_parameter_at_a_time() -> None:
    """What each parallel rank draws to initialize its shards equals the single-process model."""
    from scaletrain.models.transformer import init_values

    for args in (get_preset("debug"), get_preset("gpt2").replace(n_layers=2)):
        reference = build_model(args, "cpu", seed=3).state_dict()
        values = dict(init_values(args, 3))
        names = {n for n, _ in build_model(args, "cpu").named_parameters()}
        assert set(values) == names
        for name, value in values.items():
            assert torch.equal(value, reference[name]), name


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_mlp_compiles_whole_and_matches_eager(act: str) -> None:
    """`_GatedAct`'s backward uses aten's activation backward kernels, so torch.compile traces
    the MLP in one graph (a nested autograd call there would be a graph break)."""
    from scaletrain.models.layers import FeedForward

    torch.manual_seed(0)
    ff = FeedForward(ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=64, ffn_dim=48,
                               mlp_act=act))
    x = torch.randn(2, 8, 32, requires_grad=True)
    compiled = torch.compile(ff, fullgraph=True, backend="aot_eager")
    compiled(x).square().sum().backward()
    got = [x.grad.clone(), *(p.grad.clone() for p in ff.parameters())]
    x.grad = None
    ff.zero_grad()
    ff(x).square().sum().backward()
    for g, r in zip(got, [x.grad, *(p.grad for p in ff.parameters())], strict=True):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)
