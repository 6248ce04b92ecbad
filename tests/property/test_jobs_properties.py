"""`envbuild job`'s script for any --train value and any option (hypothesis), run with bash and the
stand-ins of tests/behaviour/test_jobs.py: the value arrives at torchrun (or srun, sbatch,
apptainer) word for word and nothing of it runs, or it is refused naming the option."""

from __future__ import annotations

import shlex

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from envbuild.base import grammar
from property_settings import EXAMPLES
from test_jobs import job, submit
from test_jobs import stubs  # noqa: F401  (fixtures)


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(train=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=60)
       | st.lists(st.sampled_from(["train.py", "--x", "a b", ";", "&&", "$(id)", "`id`", "'", '"', "\\", "\n",
                                   "\t", "#", "|", ">", "*", "~", "${HOME}", "\x01"]), min_size=1).map("".join))
def test_any_train_value_reaches_torchrun_as_words_or_is_refused(stubs, tmp_path_factory, train):  # noqa: F811
    work = tmp_path_factory.mktemp("job")
    code, script, message = job("--image", "/shared/x.sqsh", "--nodes", "1", "--gpus-per-node", "0", "--train", train)
    try:
        words = shlex.split(train)
    except ValueError:
        words = None
    if "\0" in train or not words:
        assert code == 2 and message.startswith("--train ") and "\n" not in message, (code, message)
        return
    assert code == 0, message
    calls = submit(stubs, script, work)
    assert calls["torchrun"][0][10:] == words
    assert calls["sbatch-options"] == ["--nodes=1", "--ntasks-per-node=2", "--time=24:00:00"]
    assert sorted(p.name for p in work.iterdir()) == ["job.sbatch", "log"]


# Every option of `job` but --train (above): pieces of hostile values, alone or around a valid one.
JOB_OPTIONS = {"--image": "/shared/x.sqsh", "--time": "1-00:00", "--nodes": "1", "--gpus-per-node": "0",
               "--tasks-per-node": "2", "--runtime": "pyxis"}
JOB_PIECES = ["\n", "\r", "\t", "\x1b", "\x85", "\u2028", '"', "'", "`", "\\", "$", "$(touch PWNED)", "`touch PWNED`",
              "${HOME}", ";touch PWNED", "\n#SBATCH --wrap=id", " ", "#", "-", "/", ":", "=", ",", "1", "x" * 5000,
              "UNLIMITED", ".sif", ".sqsh", "docker://", "dockerd://", "ghcr.io#acme/envbuild:t"]


@st.composite
def job_option_values(draw):
    option = draw(st.sampled_from(sorted(JOB_OPTIONS)))
    hostile = draw(st.lists(st.sampled_from(JOB_PIECES), min_size=1, max_size=5).map("".join)
                   | st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), min_size=1,
                             max_size=30))
    benign = JOB_OPTIONS[option]
    return option, draw(st.sampled_from([hostile, benign + hostile, hostile + benign]))


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(option_value=job_option_values())
def test_any_job_option_is_refused_naming_it_or_arrives_intact(stubs, tmp_path_factory, option_value):  # noqa: F811
    """A value of --image, --time, --runtime or a count: exit 2 with one line naming the option
    (its control characters escaped), or a script that, run, hands the value on as one argument
    (the image to srun or apptainer, the time to sbatch) and runs nothing of it."""
    option, value = option_value
    args = {**JOB_OPTIONS, option: value}
    if args["--image"].endswith(".sif") or args["--image"].startswith("docker://"):
        args["--runtime"] = args["--runtime"] if option == "--runtime" else "apptainer"
    code, script, message = job(*[w for pair in args.items() for w in pair])
    event(f"{option} {'refused' if code else 'ran'}")  # --hypothesis-show-statistics: both outcomes are tried
    if code:
        # envbuild's own refusal (one line), or click's for a value that is no number or choice
        said = message or script.strip().splitlines()[-1]
        assert code == 2 and (message == "" or script == ""), (code, script)
        assert option in said, (option, value, said)
        assert "\n" not in said and not set(grammar.control_characters(value)) & set(said), said
        return
    work = tmp_path_factory.mktemp("job")
    calls = submit(stubs, script, work)
    assert f"--time={args['--time']}" in calls["sbatch-options"]
    assert f"--nodes={int(args['--nodes'])}" in calls["sbatch-options"]
    if args["--runtime"] == "pyxis":
        assert [[a for a in c if a.startswith("--container-image=")] for c in calls["srun"]] == \
            [[f"--container-image={args['--image']}"]] * 2
    else:
        assert [c[2] if c[1] == "--nv" else c[1] for c in calls["apptainer"]] == [args["--image"]] * 2  # exec [--nv] IMAGE
    assert sorted(p.name for p in work.iterdir()) == ["job.sbatch", "log"]  # nothing of the value ran
