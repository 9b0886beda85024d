"""Why a service's pods cannot run, as one Degraded sentence (pure; pod JSON as the API
server and the kubelet write it)."""

from __future__ import annotations

from typing import Any

from phasefleet.api.spec import DEFAULT_IMAGE
from phasefleet.operator.status import Problem, degraded_news, pod_problem

SCHEDULER_SAYS = (
    "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are"
    " available: 3 No preemption victims found for incoming pod."
)


def pod(name: str, role: str = "decode", **status: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "team-a",
            "labels": {"phasefleet.dev/inferenceservice": "llm", "phasefleet.dev/role": role},
        },
        "status": {"phase": "Pending", **status},
    }


def unschedulable(message: str) -> dict[str, Any]:
    return {
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": message,
                "lastProbeTime": None,
                "lastTransitionTime": "2026-11-22T10:00:00Z",
            }
        ]
    }


def engine(**fields: Any) -> dict[str, Any]:
    return {
        "containerStatuses": [
            {
                "name": "engine",
                "image": "ghcr.io/phasefleet/engine:0.4.0",
                "imageID": "",
                "ready": False,
                "started": False,
                "restartCount": 3,
                **fields,
            }
        ]
    }


def crashed(code: int, reason: str, message: str | None = None) -> dict[str, Any]:
    terminated: dict[str, Any] = {
        "exitCode": code,
        "reason": reason,
        "startedAt": "2026-11-22T10:00:01Z",
        "finishedAt": "2026-11-22T10:00:09Z",
    }
    if message is not None:
        terminated["message"] = message
    return engine(
        state={
            "waiting": {
                "reason": "CrashLoopBackOff",
                "message": "back-off 40s restarting failed container=engine pod=llm-decode-x2",
            }
        },
        lastState={"terminated": terminated},
    )


def test_unschedulable_for_want_of_gpus_quotes_the_scheduler_and_says_what_to_lower():
    problem = pod_problem([pod("llm-decode-x2", **unschedulable(SCHEDULER_SAYS))])
    assert problem == Problem(
        "PodUnschedulable",
        "Pod team-a/llm-decode-x2 (pool decode) cannot be scheduled (0/3 nodes are available:"
        " 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available: 3 No preemption"
        " victims found for incoming pod.); ask for fewer GPUs per pod"
        " (spec.decode.tensorParallelSize and the nvidia.com/gpu limit in spec.decode.resources:"
        " all of a pod's GPUs must be on one node) or fewer replicas, add nodes with free GPUs,"
        " or with autoscaling set a spec.autoscaling.gpuBudget the cluster holds",
    )


def test_an_untolerated_taint_asks_for_the_toleration():
    said = (
        "0/3 nodes are available: 1 Insufficient cpu, 2 node(s) had untolerated taint"
        " {nvidia.com/gpu: present}."
    )
    problem = pod_problem([pod("llm-worker-a", role="worker", **unschedulable(said))])
    assert problem is not None and problem.reason == "PodUnschedulable"
    assert problem.message.endswith(
        "add the nodes' taint to spec.worker.tolerations, or free untainted nodes"
    )


def test_a_crash_loop_quotes_the_termination_message_not_the_back_off():
    said = "model folder /models/missing does not exist: put the model there, or point ..."
    problem = pod_problem([pod("llm-decode-x2", **crashed(2, "Error", said))])
    assert problem == Problem(
        "ContainerFailing",
        "Pod team-a/llm-decode-x2 (pool decode) keeps failing: container engine exited with"
        f" code 2 ({said}); change what the message names (kubectl logs --previous has the"
        " rest)",
    )


def test_flags_the_image_does_not_know_ask_for_the_operators_release():
    """An image older than the operator exits with argparse's usage and error (the log tail is
    the termination message): the sentence names the flags, the image and both fixes."""
    tail = (
        "usage: phasefleet router [-h] [--port PORT] [--policy {least-loaded,prefix-aware}]\n"
        "phasefleet router: error: unrecognized arguments: --tpot-target-ms 40\n"
    )
    problem = pod_problem([pod("llm-router-x2", role="router", **crashed(2, "Error", tail))])
    assert problem == Problem(
        "ContainerFailing",
        "Pod team-a/llm-router-x2 (pool router) keeps failing: container engine (image"
        " ghcr.io/phasefleet/engine:0.4.0) does not know the flags --tpot-target-ms 40; if"
        " spec.runtime.extraArgs has them, fix or remove them, else the image is of an older"
        " release than this operator: set spec.runtime.image to one of the operator's release"
        f" (its default, {DEFAULT_IMAGE})",
    )


def test_the_same_crash_reads_the_same_after_another_restart():
    said = "out of memory loading model /models/m (RuntimeError: ...): lower --num-kv-blocks"
    first = crashed(1, "Error", said)
    later = crashed(1, "Error", said)
    later["containerStatuses"][0]["restartCount"] = 9
    later["containerStatuses"][0]["state"]["waiting"]["message"] = "back-off 5m0s restarting"
    assert pod_problem([pod("p", **first)]) == pod_problem([pod("p", **later)])


def test_a_container_running_again_after_a_crash_still_reports_it_until_ready():
    status = crashed(2, "Error", "model folder /m does not exist")
    status["containerStatuses"][0]["state"] = {"running": {"startedAt": "2026-11-22T10:01:00Z"}}
    problem = pod_problem([pod("p", **status)])
    assert problem is not None and "model folder /m does not exist" in problem.message
    status["containerStatuses"][0]["started"] = True  # loaded again, merely not ready yet
    assert pod_problem([pod("p", **status)]) is None
    status["containerStatuses"][0]["ready"] = True
    assert pod_problem([pod("p", **status)]) is None


def test_oom_killed_asks_for_more_memory():
    problem = pod_problem([pod("llm-decode-x2", **crashed(137, "OOMKilled"))])
    assert problem == Problem(
        "ContainerFailing",
        "Pod team-a/llm-decode-x2 (pool decode) keeps failing: container engine was killed for"
        " exceeding its memory limit (OOMKilled, exit code 137); raise"
        " spec.decode.resources.limits.memory, or lower maxModelLen or maxNumSeqs",
    )


def test_an_exit_without_a_message_points_at_the_previous_log():
    problem = pod_problem([pod("llm-decode-x2", **crashed(1, "Error"))])
    assert problem is not None
    assert problem.message == (
        "Pod team-a/llm-decode-x2 (pool decode) keeps failing: container engine exited with"
        " code 1 and left no message; read kubectl logs --previous -c engine"
        " team-a/llm-decode-x2 for the error"
    )


def test_a_log_tail_keeps_its_end():
    tail = "\n".join(f"line {i}" for i in range(300)) + "\nValueError: the real cause"
    problem = pod_problem([pod("p", **crashed(1, "Error", tail))])
    assert problem is not None
    quoted = problem.message.split("exited with code 1 (", 1)[1].split(");", 1)[0]
    assert quoted.startswith("...") and quoted.endswith("line 299 ValueError: the real cause")
    assert len(quoted) == 600 and "line 0 " not in quoted


def test_an_image_that_cannot_be_pulled():
    said = (
        'failed to pull and unpack image "registry.invalid/phasefleet/engine:0.4.0": failed to'
        " resolve reference: dial tcp: lookup registry.invalid: no such host"
    )
    status = engine(state={"waiting": {"reason": "ErrImagePull", "message": said}})
    problem = pod_problem([pod("llm-decode-x2", **status)])
    assert problem is not None and problem.reason == "PodCannotStart"
    assert problem.message.startswith(
        "Pod team-a/llm-decode-x2 (pool decode) cannot start (ErrImagePull: failed to pull"
    )
    assert problem.message.endswith("; check spec.runtime.image and the node's pull access")


def test_the_back_off_between_pulls_reads_as_the_failed_pull():
    said = 'failed to pull and unpack image "registry.invalid/e:1": no such host'
    pulling = engine(state={"waiting": {"reason": "ErrImagePull", "message": said}})
    backing_off = engine(
        state={
            "waiting": {
                "reason": "ImagePullBackOff",
                "message": f'Back-off pulling image "registry.invalid/e:1": ErrImagePull: {said}',
            }
        }
    )
    assert pod_problem([pod("p", **pulling)]) == pod_problem([pod("p", **backing_off)])
    older = engine(
        state={"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "x"'}}
    )
    problem = pod_problem([pod("p", **older)])
    assert problem is not None
    assert '(ImagePullBackOff: Back-off pulling image "x")' in problem.message


def test_worker_pools_come_before_the_router_and_deleting_pods_are_skipped():
    router = pod("llm-a-router", role="router", **crashed(1, "Error", "router broke"))
    leaving = pod("llm-b-decode-old", **crashed(1, "Error", "old pod"))
    leaving["metadata"]["deletionTimestamp"] = "2026-11-22T10:00:00Z"
    worker = pod("llm-c-decode-new", **crashed(2, "Error", "model folder /m does not exist"))
    problem = pod_problem([router, leaving, worker])
    assert problem is not None and "llm-c-decode-new" in problem.message
    assert pod_problem([router, leaving]) is not None
    assert "llm-a-router (pool router)" in str(pod_problem([router, leaving]))


def test_pods_that_start_or_load_are_not_problems():
    creating = engine(state={"waiting": {"reason": "ContainerCreating"}}, restartCount=0)
    loading = engine(state={"running": {"startedAt": "2026-11-22T10:00:00Z"}}, restartCount=0)
    completed = crashed(0, "Completed")
    assert pod_problem([pod("a", **creating), pod("b", **loading), pod("c", **completed)]) is None
    assert pod_problem([pod("d")]) is None  # not scheduled yet, no verdict


def degraded(status: str, message: str = "") -> dict[str, Any]:
    return {
        "conditions": [{"type": "Degraded", "status": status, "reason": "R", "message": message}]
    }


def test_a_degraded_condition_is_news_once_per_text():
    assert degraded_news(degraded("True", "a"), {}) == Problem("R", "a")
    assert degraded_news(degraded("True", "a"), degraded("False")) == Problem("R", "a")
    assert degraded_news(degraded("True", "b"), degraded("True", "a")) == Problem("R", "b")
    assert degraded_news(degraded("True", "a"), degraded("True", "a")) is None
    assert degraded_news(degraded("False"), degraded("True", "a")) is None


def test_a_failing_model_cache_download_is_the_init_containers_message() -> None:
    said = "model org/m: https://huggingface.co answered HTTP 503: retry later"
    fetch = {
        "name": "fetch-model",
        "image": "ghcr.io/phasefleet/engine:0.4.0",
        "imageID": "",
        "ready": False,
        "started": False,
        "restartCount": 2,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": said}},
    }
    waiting = engine(state={"waiting": {"reason": "PodInitializing"}}, restartCount=0)
    problem = pod_problem([pod("llm-decode-1", initContainerStatuses=[fetch], **waiting)])
    assert problem is not None and problem.reason == "ContainerFailing"
    assert "container fetch-model exited with code 1 (model org/m:" in problem.message
    done = {**fetch, "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}
    done.pop("lastState")
    assert pod_problem([pod("llm-decode-1", initContainerStatuses=[done], **waiting)]) is None
