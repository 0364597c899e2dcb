"""Config: defaults, TOML inheritance, overrides, validation errors, README reference."""

import dataclasses
import re
from pathlib import Path

import pytest

from slipstream.config.load import (build_config, config_from_toml_text, config_to_toml, load_config,
                                    parse_overrides, reference_markdown)
from slipstream.config.schema import Config, sections
from slipstream.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def test_every_field_has_default_and_doc():
    for name, cls in sections().items():
        for f in dataclasses.fields(cls):
            assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, f.name
            doc = f.metadata.get("doc", "")
            assert doc and "\n" not in doc, f"{name}.{f.name} needs a one-line doc string"


def test_defaults_are_the_quickstart_job():
    cfg = load_config()
    assert cfg == load_config(ROOT / "configs" / "quickstart.toml")
    assert cfg.model.preset == "gpt-mini" and cfg.model.n_layer == 6 and cfg.model.d_model == 192
    assert cfg.data.inputs == ["stdlib"] and cfg.data.tokenizer == "byte"


def test_extends_chain_and_overrides_win(tmp_path):
    (tmp_path / "base.toml").write_text('[train]\nmax_steps = 7\nseq_len = 32\n[model]\npreset = "tiny"\n')
    (tmp_path / "child.toml").write_text('extends = "base.toml"\n[train]\nmax_steps = 9\n')
    cfg = load_config(tmp_path / "child.toml", ["--train.seed=5", "optim.lr=3e-4"])
    assert cfg.train.max_steps == 9 and cfg.train.seq_len == 32 and cfg.train.seed == 5
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.model.n_layer == 2  # from the tiny preset


def test_preset_fills_only_unset_fields():
    cfg = load_config(None, ["--model.preset=gpt2", "--model.n_layer=3", "--train.seq_len=64"])
    assert cfg.model.n_layer == 3 and cfg.model.d_model == 768 and cfg.model.vocab_size == 50257


def test_extends_cycle_is_an_error(tmp_path):
    (tmp_path / "a.toml").write_text('extends = "b.toml"\n')
    (tmp_path / "b.toml").write_text('extends = "a.toml"\n')
    with pytest.raises(UserError, match="cycle"):
        load_config(tmp_path / "a.toml")


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nmax_steps = 1")
    with pytest.raises(UserError, match="not valid TOML"):
        load_config(bad)


@pytest.mark.parametrize("override, message", [
    ("--train.max_step=10", "did you mean 'max_steps'"),
    ("--trian.max_steps=10", "did you mean 'train'"),
    ("--train.max_steps=ten", "expected an integer"),
    ("--train.max_steps=0", "must be >= 1"),
    ("--optim.lr=0", "must be > 0"),
    ("--optim.schedule=cosin", "choose one of: cosine, wsd, constant"),
    ("--model.preset=gpt3", "did you mean 'gpt2'"),
    ("--logging.tensorboard=maybe", "expected a boolean"),
    ("--train.seq_len=4096", "exceeds model.max_seq_len"),
    ("--model.n_head=5", "divisible by model.n_head"),
    ("max_steps=3", "section and a key"),
    ("--train.max_steps", "section.key=value"),
])
def test_bad_overrides_name_the_problem(override, message):
    with pytest.raises(UserError) as err:
        load_config(None, [override])
    assert message.lower() in str(err.value).lower()


def test_wrong_type_in_toml(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[train]\nmax_steps = "many"\n')
    with pytest.raises(UserError, match=r"train.max_steps = 'many': expected an integer"):
        load_config(p)
    p.write_text('[train]\nmax_steps = true\n')
    with pytest.raises(UserError, match="expected an integer"):
        load_config(p)
    p.write_text('[data]\ninputs = [1, 2]\n')
    with pytest.raises(UserError, match="list of strings"):
        load_config(p)


def test_list_override_forms():
    assert parse_overrides(["--data.inputs=a.txt,b.txt"])["data"]["inputs"] == ["a.txt", "b.txt"]
    assert parse_overrides(['--data.inputs=["x y.txt"]'])["data"]["inputs"] == ["x y.txt"]


def test_toml_round_trip():
    cfg = load_config(None, ["--model.preset=llama-tiny", "--train.seq_len=64", "--optim.schedule=wsd"])
    again = config_from_toml_text(config_to_toml(cfg))
    assert again == cfg
    assert isinstance(again, Config)


def test_build_config_rejects_non_table_section():
    with pytest.raises(UserError, match="must be a table"):
        build_config({"train": 3})


def test_readme_config_reference_is_current():
    """The README's config reference is generated from the schema: regenerate with
    `slipstream config reference` when this fails."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- config-reference:start -->\n(.*?)<!-- config-reference:end -->", readme, re.S)
    assert match, "README.md lacks the config-reference markers"
    assert match.group(1).strip() == reference_markdown().strip()


def test_table_fields_from_toml_and_every_override_form(tmp_path):
    path = tmp_path / "mix.toml"
    path.write_text('[data]\nsources = {web = "data/web", code = "s3://bucket/code"}\n'
                    '[data.mixture]\nweb = 0.7\ncode = 0.3\n')
    cfg = load_config(path)
    assert cfg.data.sources == {"web": "data/web", "code": "s3://bucket/code"}
    assert cfg.data.mixture == {"web": 0.7, "code": 0.3}
    # One entry changes, the others stay (TOML tables merge).
    assert load_config(path, ["--data.mixture.web=0.5"]).data.mixture == {"web": 0.5, "code": 0.3}
    inline = load_config(None, ["--data.sources={a = \"x\", b = \"y\"}", "--data.mixture=a=1,b=3"])
    assert inline.data.sources == {"a": "x", "b": "y"} and inline.data.mixture == {"a": 1.0, "b": 3.0}
    assert config_from_toml_text(config_to_toml(cfg)) == cfg  # the run's config.toml round-trips
    assert load_config().data.mixture == {} and load_config().data.sources == {}


@pytest.mark.parametrize("overrides, message", [
    (["--data.mixture.web=0.5"], "does not define"),
    (["--data.sources.web=d"], "data.mixture is empty"),
    (["--data.sources.web=d", "--data.mixture.web=-1"], "must be >= 0"),
    (["--data.sources.web=d", "--data.mixture.web=0"], "at least one > 0"),
    (["--data.sources.web=d", "--data.mixture.web=lots"], "expected a number"),
    (["--data.tokenizer.web=x"], "is not a table"),
    (["--data.mixture={web = 0.5"], "expected a table"),
])
def test_table_field_errors_name_the_fix(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, overrides)
