"""Parameters: the embedded default loads, overrides apply, and every bad value is one line naming where it came from."""

import subprocess
import sys
from pathlib import Path

import pytest

from qerl.config import DEFAULT_PARAMS, ConfigError, Settings, load_settings, settings_from_dict, split_overrides
from tests.patience import patience

REPO = Path(__file__).resolve().parent.parent


def test_default_params_load_and_describe_the_embedded_default():
    s = load_settings()
    assert s.model.path == "embedded"
    assert s.quant.scheme == "nvfp4"
    assert s.aqn.enabled and s.aqn.num_stages >= 2
    assert s.data.name == "arithmetic"
    assert s.train.rewards == {"accuracy": 1.0}


def test_every_params_file_in_the_repo_is_valid():
    files = sorted((REPO / "params").glob("*.yaml"))
    assert DEFAULT_PARAMS in files
    for f in files:
        load_settings(f)


def test_overrides_use_dvc_syntax_and_parse_yaml_scalars():
    s = load_settings(overrides=["lora.rank=8", "grpo.loss_type=dr_grpo", "rollout.stop_strings=['</s>']",
                                 "optim.lr=3e-4", "aqn.enabled=false", "quant.quantized_path=null"])
    assert s.lora.rank == 8 and isinstance(s.lora.rank, int)
    assert s.grpo.loss_type == "dr_grpo"
    assert s.rollout.stop_strings == ["</s>"]
    assert s.optim.lr == pytest.approx(3e-4)
    assert s.aqn.enabled is False
    assert s.quant.quantized_path is None


def test_a_list_of_overrides_keeps_the_commas_of_a_flow_value():
    """`--arms NAME:k=v,k=v` and bench_grpo_step's `--variants`: a per-layer scheme map is one override."""
    items = split_overrides('quant.scheme=nvfp4, quant.layer_schemes={"*.down_proj": fp8, "*.v_proj": fp8},'
                            "lora.target_modules=[q_proj, v_proj],grpo.loss_type='a,b',")
    assert items == ["quant.scheme=nvfp4", 'quant.layer_schemes={"*.down_proj": fp8, "*.v_proj": fp8}',
                     "lora.target_modules=[q_proj, v_proj]", "grpo.loss_type='a,b'"]
    settings = load_settings(DEFAULT_PARAMS, overrides=items[:2])
    assert settings.quant.layer_schemes == {"*.down_proj": "fp8", "*.v_proj": "fp8"}
    assert split_overrides("a.b=1,,c.d=2") == ["a.b=1", "c.d=2"] and split_overrides("") == []


def test_unset_keys_take_defaults():
    s = settings_from_dict({"lora": {"rank": 4}})
    assert s.lora.rank == 4 and s.lora.alpha == Settings().lora.alpha


@pytest.mark.parametrize(
    "override, message",
    [
        ("lora.rnak=3", "-S lora.rnak=3: unknown key 'lora.rnak' (did you mean 'rank'?)"),
        ("lora.rank=-1", "-S lora.rank=-1: lora.rank = -1: must be > 0"),
        ("lora.rank=2.5", "-S lora.rank=2.5: lora.rank = 2.5: expected an integer"),
        ("grpo.loss_type=ppo", "-S grpo.loss_type=ppo: grpo.loss_type = 'ppo': expected one of 'grpo', 'dapo', 'dr_grpo', "
                               "'bnpo', 'cispo', 'sapo'"),
        ("optim.lr=fast", "-S optim.lr=fast: optim.lr = 'fast': expected a number"),
        ("aqn.enabled=3", "-S aqn.enabled=3: aqn.enabled = 3: expected true or false"),
        ("rollout.top_p=1.5", "-S rollout.top_p=1.5: rollout.top_p = 1.5: must be <= 1"),
        ("optim.lr=.nan", "-S optim.lr=.nan: optim.lr = nan: expected a finite number"),
        ("data.operators=/", "-S data.operators=/: data.operators = '/': use a non-empty subset of '+-*'"),
        ("bogus.key=1", "-S bogus.key=1: unknown key 'bogus'"),
        ("aqn.schedule=cosine", "-S aqn.schedule=cosine: aqn.schedule = 'cosine': expected one of 'geometric', 'entropy'"),
        ("quant.scheme=nvfp5", "-S quant.scheme=nvfp5: quant.scheme = 'nvfp5': expected one of 'nvfp4', 'mxfp4', "
                               "'nf4', 'fp8', 'bf16', 'nf4-bnb' (did you mean 'nvfp4'?)"),
        ("quant.gpu_layout=glon", "-S quant.gpu_layout=glon: quant.gpu_layout = 'glon': expected one of 'auto', "
                                  "'humming', 'qerl', 'gluon' (did you mean 'gluon'?)"),
        ("aqn.sigma_rate=1", "-S aqn.sigma_rate=1: aqn.sigma_rate = 1.0: must be > 1"),
        ("aqn.target_entropy=-0.5", "-S aqn.target_entropy=-0.5: aqn.target_entropy = -0.5: must be > 0"),
        ("norank", "-S norank: expected section.key=value"),
    ],
)
def test_bad_override_is_one_line_naming_flag_key_and_value(override, message):
    with pytest.raises(ConfigError) as err:
        load_settings(overrides=[override])
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_bad_value_in_a_file_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: x\n\nlora:\n  rank: 0\n")
    with pytest.raises(ConfigError, match=rf"^{bad}:5: lora.rank = 0: must be > 0$"):
        load_settings(bad)
    bad.write_text("lora:\n  rank: 4\neval:\n  num_samples: 4\n  temperature: 0\n")
    with pytest.raises(ConfigError, match=rf"^{bad}:4: eval.num_samples = 4: k > 1 samples need temperature > 0$"):
        load_settings(bad)
    bad.write_text("lora: [1, 2\n")
    with pytest.raises(ConfigError, match=rf"^{bad}:\d+: invalid YAML"):
        load_settings(bad)


def test_entropy_schedule_settings_are_checked_together(tmp_path):
    entropy = ["aqn.schedule=entropy", "aqn.target_entropy=0.8"]
    s = load_settings(overrides=entropy)
    assert s.aqn.schedule == "entropy" and s.aqn.sigma_min <= s.aqn.sigma_start <= s.aqn.sigma_max
    cases = [
        (["aqn.schedule=entropy"], "aqn.target_entropy = None: schedule 'entropy' needs a target"),
        (entropy + ["aqn.sigma_min=0.1", "aqn.sigma_max=0.01"], "-S aqn.sigma_max=0.01: aqn.sigma_max = 0.01: must "
                                                                 "be >= sigma_min = 0.1"),
        (entropy + ["aqn.sigma_start=0.5"], "-S aqn.sigma_start=0.5: aqn.sigma_start = 0.5: schedule 'entropy' "
                                            "starts there, so it must lie in [sigma_min, sigma_max]"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError) as err:
            load_settings(overrides=overrides)
        assert message in str(err.value) and "\n" not in str(err.value)
    assert load_settings(overrides=["aqn.schedule=entropy", "aqn.enabled=false"]).aqn.enabled is False  # off: unchecked


def test_missing_params_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="params file not found"):
        load_settings(tmp_path / "nope.yaml")


def test_flat_dict_and_fingerprint_for_trackers_and_caches():
    a, b = load_settings(), load_settings(overrides=["lora.rank=4"])
    flat = a.to_flat_dict()
    assert flat["lora.rank"] == 16 and flat["lora.target_modules"].startswith("[")
    assert a.fingerprint("quant", "model") == b.fingerprint("quant", "model")
    assert a.fingerprint("lora") != b.fingerprint("lora")
    assert settings_from_dict(__import__("yaml").safe_load(a.to_yaml())) == a


def test_cli_rejects_bad_params_with_one_line_and_nonzero_exit(tmp_path, qerl_here):
    bad = tmp_path / "bad.yaml"
    bad.write_text("lora:\n  rnk: 4\n")
    code, _, err = qerl_here("eval", "--params", bad)
    assert code == 2
    assert err.strip() == f"qerl: error: {bad}:2: unknown key 'lora.rnk' (did you mean 'rank'?)"
    assert "Traceback" not in err


def test_cli_params_prints_resolved_yaml():
    """A `qerl` child process: the console entry point itself (`python -m qerl.cli`), its exit code and stdout."""
    proc = subprocess.run([sys.executable, "-m", "qerl.cli", "params", "-S", "lora.rank=4"],
                          capture_output=True, text=True, cwd=REPO, timeout=patience(120))
    assert proc.returncode == 0, proc.stderr
    assert "rank: 4" in proc.stdout


def test_aqn_sigma_start_below_sigma_end_is_rejected_where_it_was_written(tmp_path):
    params = tmp_path / "p.yaml"
    params.write_text("aqn:\n  sigma_start: 1.0e-4\n  sigma_end: 1.0e-2\n")
    with pytest.raises(ConfigError, match=r"p\.yaml:2: aqn\.sigma_start = 0\.0001 < sigma_end = 0\.01") as info:
        load_settings(params)
    assert "\n" not in str(info.value)
    assert load_settings(params, ["aqn.enabled=false"]).aqn.enabled is False  # off: the sigmas do not matter
    assert load_settings(overrides=["aqn.sigma_start=1e-3", "aqn.sigma_end=1e-3"]).aqn.sigma_start == 1e-3  # constant


@pytest.mark.parametrize("override", ["aqn.sigma_start=0", "aqn.sigma_end=0.5", "aqn.sigma_start=1e-5"])
def test_an_aqn_rule_broken_by_a_flag_names_the_flag_not_the_file(override):
    with pytest.raises(ConfigError) as info:
        load_settings(overrides=[override])
    assert str(info.value).startswith(f"-S {override}: aqn.sigma_start = ")


def test_a_non_utf8_params_file_names_its_line(tmp_path):
    params = tmp_path / "p.yaml"
    params.write_bytes(b"lora:\n  rank: 8\ndata:\n  system_prompt: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"p\.yaml:4: not UTF-8 text \(byte 0xe9\)"):
        load_settings(params)


def test_overlong_prompts_policy_is_validated():
    assert load_settings().data.overlong_prompts == "error"
    assert load_settings(overrides=["data.overlong_prompts=drop"]).data.overlong_prompts == "drop"
    with pytest.raises(ConfigError, match="-S data.overlong_prompts=truncate: .*'error', 'drop'"):
        load_settings(overrides=["data.overlong_prompts=truncate"])


@pytest.mark.parametrize("key", ["train.seed", "aqn.seed", "data.seed", "eval.seed"])
def test_a_seed_beyond_64_bits_is_a_range_error_naming_the_key(tmp_path, key):
    """torch takes 64-bit seeds: a larger one said only 'Overflow when unpacking long long', after the data loaded."""
    section, name = key.split(".")
    params = tmp_path / "p.yaml"
    params.write_text(f"{section}:\n  {name}: {2**64}\n")
    with pytest.raises(ConfigError) as err:
        load_settings(params)
    assert str(err.value) == f"{params}:2: {key} = {2**64}: must be <= {2**64 - 1}"
    with pytest.raises(ConfigError, match=rf"^-S {key}=-1: {key} = -1: must be >= 0$"):
        load_settings(overrides=[f"{key}=-1"])
    assert load_settings(params, [f"{key}={2**64 - 1}"]).to_dict()[section][name] == 2**64 - 1


@pytest.mark.parametrize("text, line", [
    ("lora:\n  rank: 16\n  alpha: 32\n  rank: 4\n", "{p}:4: lora.rank is set twice (lines 2 and 4); keep one"),
    ("lora:\n  rank: 16\noptim:\n  lr: 1.0e-4\nlora:\n  alpha: 8\n",
     "{p}:5: lora is set twice (lines 1 and 5); keep one"),
])
def test_a_section_or_key_set_twice_is_refused_naming_both_lines(tmp_path, qerl_here, text, line):
    """YAML loaders keep the last of two equal keys without a word: the run used rank 4 where the file also said 16."""
    params = tmp_path / "p.yaml"
    params.write_text(text)
    code, _, err = qerl_here("params", "--params", params)
    assert code == 2
    assert err.strip() == "qerl: error: " + line.format(p=params)


def test_loss_settings_take_their_papers_defaults_and_name_contradictions(tmp_path):
    assert (Settings().grpo.epsilon_low, Settings().grpo.epsilon_high) == (0.2, 0.28)  # DAPO's, per token
    gspo = settings_from_dict({"grpo": {"importance_sampling_level": "sequence"}}).grpo
    assert (gspo.epsilon_low, gspo.epsilon_high) == (3e-4, 4e-4)  # the GSPO paper's
    nulls = load_settings(overrides=["grpo.importance_sampling_level=sequence", "grpo.epsilon_low=null",
                                     "grpo.epsilon_high=null"])  # the default params spell out 0.2 / 0.28
    assert (nulls.grpo.epsilon_low, nulls.grpo.epsilon_high) == (3e-4, 4e-4)
    assert settings_from_dict({"grpo": {"loss_type": "cispo"}}).grpo.epsilon_high == 5.0  # the weight's cap
    params = tmp_path / "p.yaml"
    params.write_text("grpo:\n  loss_type: dapo\n  epsilon_high: 0.28\n  tis_cap: 2.0\n")
    assert load_settings(params).grpo.tis_cap == 2.0  # the shorthand stays valid
    cases = [
        (["grpo.correction=mis"], "-S grpo.correction=mis: grpo.tis_cap = 2.0 is short for correction: tis, "
                                  "correction_cap: 2.0; it contradicts correction = 'mis'"),
        (["grpo.correction_cap=3"], "-S grpo.correction_cap=3: grpo.tis_cap = 2.0 is short for"),
        (["grpo.loss_type=cispo"], "-S grpo.loss_type=cispo: grpo.epsilon_high = 0.28: loss_type 'cispo' caps the "
                                   "importance weight at epsilon_high itself"),
        (["grpo.top_entropy_quantile=1.5"], "-S grpo.top_entropy_quantile=1.5: grpo.top_entropy_quantile = 1.5: "
                                            "must be <= 1"),
        (["grpo.correction=is"], "-S grpo.correction=is: grpo.correction = 'is': expected one of 'auto', 'none', 'tis', "
                                 "'mis'"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError) as err:
            load_settings(params, overrides)
        assert str(err.value).startswith(message) and "\n" not in str(err.value)
    params.write_text("grpo:\n  loss_type: cispo\n  epsilon_high: 0.28\n")
    with pytest.raises(ConfigError, match=rf"^{params}:3: grpo.epsilon_high = 0.28: loss_type 'cispo'"):
        load_settings(params)
