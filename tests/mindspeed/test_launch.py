"""``python -m mindspeed_laga.launch`` against a stand-in MindSpeed.

The stand-in ``mindspeed`` package (written to tmp_path) keeps the parts of
MindSpeed the launcher meets: ``features_manager/__init__.py`` imports the
feature base, then the manager, then sets a default features list;
``MindSpeedFeaturesManager.set_features_list`` replaces the list's contents.
The stand-in training script does what ``pretrain_gpt.py`` does through
``mindspeed_llm``: imports the manager, replaces the list with its own, builds
the parser from the features and parses *strictly*, so an unregistered
``--mla-latent-all-gather`` fails the run.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

STANDIN = {
    "mindspeed/__init__.py": "",
    "mindspeed/features_manager/feature.py": """
        class MindSpeedFeature:
            def __init__(self, feature_name, optimization_level=2):
                self.feature_name = feature_name.lower().strip().replace('-', '_')
                self.optimization_level = optimization_level
                self.default_patches = optimization_level == 0

            def register_args(self, parser):
                pass
        """,
    "mindspeed/features_manager/features_manager.py": """
        # as upstream: needs feature.py loaded first
        from mindspeed.features_manager import MindSpeedFeature

        class MindSpeedFeaturesManager:
            FEATURES_LIST = []

            @classmethod
            def set_features_list(cls, features_list):
                cls.FEATURES_LIST[:] = features_list

            @classmethod
            def register_features_args(cls, parser):
                for feature in cls.FEATURES_LIST:
                    feature.register_args(parser)
        """,
    "mindspeed/features_manager/__init__.py": """
        from mindspeed.features_manager.feature import MindSpeedFeature
        from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager

        class MindSpeedDefaultFeature(MindSpeedFeature):
            def __init__(self):
                super().__init__('mindspeed-default')

        MindSpeedFeaturesManager.set_features_list([MindSpeedDefaultFeature()])
        """,
    "train.py": """
        import argparse, json, os, sys
        report = {"name": __name__, "argv": list(sys.argv),
                  "mindspeed_imported_before_script": "mindspeed" in sys.modules}
        from mindspeed.features_manager.feature import MindSpeedFeature
        from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager

        class LLMFeature(MindSpeedFeature):
            def __init__(self):
                super().__init__('llm-default')

        MindSpeedFeaturesManager.set_features_list([LLMFeature()])  # as MindSpeed-LLM does
        features = MindSpeedFeaturesManager.FEATURES_LIST
        report["features_at_parse"] = [f.feature_name for f in features]
        report["laga_subclasses_mindspeed_base"] = all(
            isinstance(f, MindSpeedFeature) for f in features)
        parser = argparse.ArgumentParser(allow_abbrev=False)
        parser.add_argument("--context-parallel-size", type=int, default=1)
        parser.add_argument("--local-rank", type=int, default=None)
        MindSpeedFeaturesManager.register_features_args(parser)
        report["args"] = vars(parser.parse_args())  # strict, like Megatron's parse_args
        with open(os.environ["LAUNCH_REPORT"], "w") as f:
            json.dump(report, f)
        """,
}


@pytest.fixture
def standin(tmp_path):
    for rel, text in STANDIN.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def run(cwd, argv, with_mindspeed=True):
    env = dict(os.environ, LAUNCH_REPORT=str(cwd / "report.json"))
    env["PYTHONPATH"] = os.pathsep.join(
        ([str(cwd)] if with_mindspeed else []) + [p for p in [os.environ.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)
    report = cwd / "report.json"
    return proc, (json.loads(report.read_text()) if report.exists() else None)


def test_feature_is_registered_before_parsing_and_script_runs_as_main(standin):
    proc, report = run(standin, ["-m", "mindspeed_laga.launch", "train.py",
                                 "--mla-latent-all-gather", "--context-parallel-size", "2"])
    assert proc.returncode == 0, proc.stderr
    assert report["name"] == "__main__"
    assert report["argv"] == ["train.py", "--mla-latent-all-gather", "--context-parallel-size", "2"]
    # survived MindSpeed-LLM's reset of the list, and sits last
    assert report["features_at_parse"] == ["llm_default", "mla_latent_all_gather"]
    assert report["laga_subclasses_mindspeed_base"]
    assert report["args"]["mla_latent_all_gather"] is True
    assert report["args"]["mla_laga_kernel"] == "auto"
    # the launcher itself imported nothing of MindSpeed: the script's import order is kept
    assert report["mindspeed_imported_before_script"] is False


def test_without_the_launcher_the_flag_is_rejected(standin):
    proc, report = run(standin, ["train.py", "--mla-latent-all-gather"])
    assert proc.returncode != 0 and report is None
    assert "unrecognized arguments: --mla-latent-all-gather" in proc.stderr


def test_options_before_the_script_are_passed_to_it(standin):
    # python -m torch.distributed.launch -m ... puts --local-rank=N before the script
    proc, report = run(standin, ["-m", "mindspeed_laga.launch", "--local-rank=3", "train.py",
                                 "--mla-latent-all-gather"])
    assert proc.returncode == 0, proc.stderr
    assert report["argv"] == ["train.py", "--mla-latent-all-gather", "--local-rank=3"]
    assert report["args"]["local_rank"] == 3


def test_manager_already_imported_is_patched_in_place(standin):
    code = ("import mindspeed.features_manager; from mindspeed_laga.launch import main; "
            "main(['train.py', '--mla-latent-all-gather'])")
    proc, report = run(standin, ["-c", code])
    assert proc.returncode == 0, proc.stderr
    assert report["features_at_parse"] == ["llm_default", "mla_latent_all_gather"]


def test_missing_mindspeed_is_a_clear_error(standin):
    bare = standin / "bare"  # python -m puts the cwd on sys.path: keep the stand-in out of it
    bare.mkdir()
    (bare / "train.py").write_text((standin / "train.py").read_text())
    proc, report = run(bare, ["-m", "mindspeed_laga.launch", "train.py"], with_mindspeed=False)
    assert proc.returncode != 0 and report is None
    assert "MindSpeed is not importable" in proc.stderr


def test_missing_script_is_a_clear_error(standin):
    proc, _ = run(standin, ["-m", "mindspeed_laga.launch", "no_such_script.py"])
    assert proc.returncode != 0 and "not found" in proc.stderr


# --- against the real MindSpeed, MindSpeed-LLM and Megatron sources --------------------------

REAL_TRAIN = """
    # What pretrain_gpt.py does up to its arguments, on the real sources: Megatron's
    # strict parse_args with MindSpeed-LLM's features (their list reset included).
    import json, os, sys
    report = {"name": __name__, "mindspeed_imported_before_script": "mindspeed" in sys.modules}
    sys.path.insert(0, os.environ["LAGA_TESTS_DIR"])
    from support import mindspeed_llm_real as real
    real.prepare(register_laga=False)  # sources, stubs, CPU shims; no registration of LAGA
    args = real.megatron_args([a for a in real.MODEL if a != "--mla-latent-all-gather"]
                             + sys.argv[1:], world_size=2)
    from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager
    report["features_at_parse"] = [type(f).__name__ for f in MindSpeedFeaturesManager.FEATURES_LIST]
    report["args"] = {k: getattr(args, k) for k in (
        "mla_latent_all_gather", "mla_laga_kernel", "context_parallel_size")}
    with open(os.environ["LAUNCH_REPORT"], "w") as f:
        json.dump(report, f)
    """


@pytest.fixture
def real_train(tmp_path, host_sources):
    (tmp_path / "train.py").write_text(textwrap.dedent(REAL_TRAIN))
    # installed as a user has them: the launcher looks for MindSpeed before the script runs
    path = [host_sources[k] for k in ("MEGATRON_SRC", "MINDSPEED_SRC", "MINDSPEED_LLM_SRC")]
    env = dict(host_sources, LAGA_TESTS_DIR=str(Path(__file__).resolve().parents[1]),
               PYTHONPATH=os.pathsep.join(path + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    return tmp_path, env


def run_real(cwd, env, argv):
    env = dict(os.environ, **env, LAUNCH_REPORT=str(cwd / "report.json"))
    proc = subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    report = cwd / "report.json"
    return proc, (json.loads(report.read_text()) if report.exists() else None)


def test_real_mindspeed_launcher_registers_the_feature(real_train):
    cwd, env = real_train
    proc, report = run_real(cwd, env, ["-m", "mindspeed_laga.launch", "train.py",
                                       "--mla-latent-all-gather", "--context-parallel-size", "2"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert report["name"] == "__main__"
    assert report["mindspeed_imported_before_script"] is False
    # MindSpeed-LLM's own features, then LAGA's, last, after its reset of the list
    assert len(report["features_at_parse"]) > 1
    assert report["features_at_parse"][-1] == "LAGAFeature"
    assert report["args"] == {"mla_latent_all_gather": True, "mla_laga_kernel": "auto",
                              "context_parallel_size": 2}


@pytest.mark.parametrize("option", [["--mla-laga-overlap"], ["--mla-laga-kernel", "eager"]])
def test_real_mindspeed_refuses_a_laga_option_without_the_flag(real_train, option):
    """Through the real argument pipeline: the option parses (LAGA's flags are registered)
    and MindSpeed's validation of the feature refuses it, naming it and the fix."""
    cwd, env = real_train
    proc, report = run_real(cwd, env, ["-m", "mindspeed_laga.launch", "train.py",
                                       "--context-parallel-size", "2", *option])
    assert proc.returncode != 0 and report is None, proc.stdout[-2000:]
    assert (f"{option[0]} acts only with --mla-latent-all-gather, which is off: add "
            f"--mla-latent-all-gather to train with LAGA, or drop {option[0]}") in proc.stderr, \
        proc.stderr[-6000:]


def test_real_mindspeed_rejects_the_flag_without_the_launcher(real_train):
    cwd, env = real_train
    proc, report = run_real(cwd, env, ["train.py", "--mla-latent-all-gather"])
    assert proc.returncode != 0 and report is None
    assert "unrecognized arguments: --mla-latent-all-gather" in proc.stderr, proc.stderr[-6000:]
