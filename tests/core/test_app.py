from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from core.app import IGNORED_TAG, check_argv, ignored_knobs, plugin_arms, requested_plugins, study_target, sweep_ready
from core.errors import UserError
from core.testing.cli import run_cli


def test_requested_plugins_reads_lists_and_sweeps():
    assert requested_plugins(["+plugins=[eureka,envgen]", "env=minecraft"]) == ["eureka", "envgen"]
    assert requested_plugins(["+plugins=[eureka],[text2reward],[]"]) == ["eureka", "text2reward"]
    assert requested_plugins(["seed=1"]) == []


def test_unknown_env_is_reported_with_choices():
    with pytest.raises(UserError, match="Unknown env 'cartpol'.*Did you mean 'cartpole'"):
        check_argv(["env=cartpol"])


@pytest.mark.parametrize(
    "args, expected",
    [
        (["+plugins=[nope]"], "Unknown plugin 'nope'"),
        (["env=nowhere"], "Unknown env 'nowhere'"),
        (["trainer.frames=="], "trainer.frames"),
    ],
)
def test_bad_input_exits_nonzero_with_a_short_message(args, expected):
    proc = run_cli(None, *args, timeout=120)
    assert proc.returncode != 0
    output = proc.output
    assert expected in output.replace("\n", " ")
    assert "Traceback" not in output


@pytest.mark.parametrize("prefix", ["", "+", "++"])
def test_a_plugin_key_its_schema_lacks_is_refused_before_hydra(prefix):
    # Hydra would say "Key 'sample' is not in struct" and suggest '+', which adds a key nobody reads
    with pytest.raises(UserError) as err:
        check_argv(["+plugins=[eureka]", f"{prefix}plugins.eureka.sample=3"])
    message = str(err.value)
    assert message.startswith("Unknown config key 'plugins.eureka.sample'. Did you mean 'samples'?")
    assert "'plugins.eureka' accepts: iterations, final_seeds, samples" in message and "\n" not in message


def test_plugin_keys_of_the_schema_pass():
    check_argv(["+plugins=[eureka]", "plugins.eureka.samples=2", "plugins.eureka.iterations=1,2", "~plugins.eureka.x"])
    check_argv(["-m", "+plugins=[eureka],[]", "plugins.eureka.samples=4"])


def test_a_key_of_a_plugin_not_enabled_is_refused():
    with pytest.raises(
        UserError,
        match=r"'plugins.eureka.samples' is set but plugin 'eureka' is not enabled in this run. "
        r"Enable it with \+plugins=\[eureka\]",
    ):
        check_argv(["+plugins=[text2reward]", "plugins.eureka.samples=2"])
    with pytest.raises(UserError, match="plugin 'eurka', which does not exist. Did you mean 'eureka'"):
        check_argv(["+plugins=[eureka]", "plugins.eurka.samples=2"])
    check_argv(["--config-name", "my_study", "plugins.eureka.samples=2"])  # that file may enable it


def test_the_summary_names_the_results_store(capsys):
    from core.app import print_summary
    from core.loop import RunSummary

    summary = RunSummary("return", 1.0, 10, 1.0, 1, 0, "rid", "ui", results_store="/x/llm4rl-results.sqlite")
    print_summary(summary)
    assert "results store: /x/llm4rl-results.sqlite (none reused)" in capsys.readouterr().out
    summary.reused = 1
    print_summary(summary)
    assert "1 training(s) reused" in " ".join(capsys.readouterr().out.split())


def test_the_summary_says_where_llm_replies_are_kept_and_how_many_came_from_there(capsys):
    from core.app import print_summary
    from core.loop import RunSummary

    summary = RunSummary(
        "return",
        1.0,
        10,
        1.0,
        1,
        0,
        "rid",
        "ui",
        llm={"llm/calls": 3, "llm/cache_hits": 2},
        llm_cache="/home/u/.cache/llm4rl/llm_cache.sqlite",
    )
    print_summary(summary)
    out = " ".join(capsys.readouterr().out.split())
    assert "LLM replies kept in /home/u/.cache/llm4rl/llm_cache.sqlite: 2 answered from it" in out
    assert "llm.cache_path=<file> uses another" in out


def test_the_summary_counts_sampled_usable_and_trained_candidates(capsys):
    from core.app import print_summary
    from core.loop import RunSummary

    print_summary(RunSummary("return", 1.0, 10, 1.0, 8, 3, "rid", "ui", rejected=2))
    assert "candidates: 8 sampled, 6 usable, 5 trained" in capsys.readouterr().out
    print_summary(RunSummary("return", 1.0, 10, 1.0, 4, 0, "rid", "ui"))
    assert "candidates: 4  frames" in capsys.readouterr().out


# -- sweeping a plugin's knob in a study with a baseline arm (docs/ablations.md) ------------------


def test_plugin_arms_are_read_from_sweeps_and_lists():
    assert plugin_arms(["+plugins=[eureka],[]", "seed=0,1"]) == [["eureka"], []]
    assert plugin_arms(["+plugins=[eureka,envgen]"]) == [["eureka", "envgen"]]
    assert plugin_arms(["+plugins=eureka,text2reward"]) == [["eureka"], ["text2reward"]]
    assert plugin_arms(["seed=1"]) is None


def test_overrides_are_read_with_hydras_own_grammar():
    # what Hydra's parser reads and a pattern over the text would not: choice(), quoted
    # values, a deletion, flags and a refused argument (left for Hydra to report)
    argv = [
        "-m",
        "--config-name",
        "config",
        "+plugins=choice([eureka],[text2reward,envgen])",
        "seed=range(0,3)",
        "experiment='a,b'",
        "~plugins.eureka.samples",
        "bad=[",
        "env=choice(cartpole,mountaincar)",
    ]
    assert plugin_arms(argv) == [["eureka"], ["text2reward", "envgen"]]
    assert requested_plugins(argv) == ["eureka", "text2reward", "envgen"]
    check_argv(argv)  # the deletion sets no key; both envs exist
    with pytest.raises(UserError, match=r"Unknown env 'mountaincr'\. Did you mean 'mountaincar'"):
        check_argv(["env=choice(cartpole,mountaincr)"])
    assert study_target(["experiment='a,b'", "tracking.uri=sqlite:///x.db"]) == ("sqlite:///x.db", "a,b")


def test_a_knob_reaches_every_arm_of_a_sweep_where_some_arm_lacks_its_plugin():
    argv = ["-m", "+plugins=[eureka],[]", "plugins.eureka.iterations=2", "seed=0,1"]
    check_argv(argv)
    assert sweep_ready(argv) == ["-m", "+plugins=[eureka],[]", "++plugins.eureka.iterations=2", "seed=0,1"]
    # every arm runs it: left as written
    assert sweep_ready(["+plugins=[eureka]", "plugins.eureka.iterations=2"]) == [
        "+plugins=[eureka]",
        "plugins.eureka.iterations=2",
    ]


def test_the_arm_without_the_plugin_drops_its_knob_and_says_so():
    baseline = OmegaConf.create({"seed": 0, "plugins": {"eureka": {"iterations": 2}}})
    OmegaConf.set_struct(baseline, True)
    assert ignored_knobs(baseline, ["+plugins=[]", "++plugins.eureka.iterations=2"]) == ["plugins.eureka.iterations=2"]
    assert dict(baseline.plugins) == {}  # not a eureka run
    arm = OmegaConf.create({"plugins": {"eureka": {"iterations": 2, "samples": 16}}})
    assert ignored_knobs(arm, ["+plugins=[eureka]", "++plugins.eureka.iterations=2"]) == []
    assert arm.plugins.eureka.iterations == 2
    assert IGNORED_TAG == "llm4rl.ignored_overrides"


def test_hydras_plus_form_of_a_knob_is_refused_with_the_right_form():
    with pytest.raises(UserError) as err:
        check_argv(["-m", "+plugins=[eureka],[]", "+plugins.eureka.iterations=2"])
    message = str(err.value)
    assert "write 'plugins.eureka.iterations=2' without '+'" in message
    assert "docs/ablations.md, 'Sweeping a plugin's knob'" in message


@pytest.fixture
def llm_server():
    """An OpenAI-compatible chat endpoint on 127.0.0.1 answering with the shared fake LLM; yields its api_base."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    from core.testing.fakes import answer

    class Completions(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # the handler's API
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": answer(body["messages"])},
                    "finish_reason": "stop",
                }
                for i in range(int(body.get("n") or 1))
            ]
            data = json.dumps(
                {
                    "id": "fake",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "fake",
                    "choices": choices,
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Completions)
    Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


@pytest.mark.slow
def test_a_baseline_arm_and_a_plugin_arm_sweep_a_knob(tmp_path, llm_server):
    import mlflow

    args = [
        "-m",
        "+plugins=[eureka],[]",
        "plugins.eureka.iterations=1",
        "plugins.eureka.samples=1",
        "trainer.frames=512",
        "trainer.num_envs=4",
        "trainer.rollout_steps=32",
        "trainer.epochs=1",
        "trainer.eval_every=0",
        "trainer.eval_episodes=1",
        "executor=inprocess",
        "progress=false",
        "save_policy=false",
        "tracking.log_plots=false",
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        f"cache_dir={tmp_path}/cache",
        "llm=openai",
        "llm.model=openai/fake-llm",
        f"llm.api_base={llm_server}",
        "llm.api_key_env=null",
        "llm.retries=0",
        f"hydra.sweep.dir={tmp_path}/multirun",
    ]
    proc = run_cli(tmp_path, *args, records=False)
    output = proc.output
    assert proc.returncode == 0, output[-3000:]
    assert "ignored in this run" in output
    # after the study: how to compare its arms and where to look
    assert f"python -m core.report --experiment llm4rl --uri sqlite:///{tmp_path}/mlflow.db" in output.replace("\n", "")
    assert "python -m core.ui --uri" in output
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = [
        r
        for r in client.search_runs([client.get_experiment_by_name("llm4rl").experiment_id])
        if "plugins" in r.data.tags
    ]
    by_plugins = {r.data.tags["plugins"]: r for r in runs}
    assert by_plugins["none"].data.tags[IGNORED_TAG] == "plugins.eureka.iterations=1 plugins.eureka.samples=1"
    assert "plugins.eureka.iterations" not in by_plugins["none"].data.params
    assert "eureka" in by_plugins and IGNORED_TAG not in by_plugins["eureka"].data.tags


def test_help_starts_with_llm4rls_own_usage_then_hydras_groups():
    proc = run_cli(None, "--help", timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("llm4rl:") and "Usage: python -m core" in out
    assert "+plugins=[eureka] env=mountaincar" in out and "python -m core.registry" in out  # examples, other commands
    groups = out.index("== Config groups")
    assert "plugins: ellm, envgen, eureka" in out[groups:] and out.index("Usage:") < groups
    assert "trainer:\n  frames:" in out  # the composed config, to override any key


def test_a_missing_api_key_is_refused_before_any_run_is_opened(tmp_path):
    proc = run_cli(tmp_path, "+plugins=[eureka]", "llm=openai", drop_env=("OPENAI_API_KEY",), timeout=120)
    assert proc.returncode == 2, proc.output
    assert "OPENAI_API_KEY is not set" in proc.said
    assert not (tmp_path / "mlflow.db").exists()  # no MLflow run was opened (none left FAILED)
