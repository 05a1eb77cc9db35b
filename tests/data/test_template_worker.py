"""A chat template rendered in child processes: same text as in-process, and a template
that loops, balloons or exhausts memory fails its render alone, within the time limit,
while the next render works."""

from __future__ import annotations

import threading
import time

import pytest

from lathe.core.errors import CheckpointError
from lathe.data.chat_template import ChatTemplate, ChatTemplateError
from lathe.data.template_worker import TemplateWorker

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": ""}
SPIN = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"


@pytest.fixture
def worker():
    gated = ('{% if messages[0].content == "spin" %}' + SPIN + "{% endif %}"
             '{% if messages[0].content == "huge" %}{{ "x" * 2000000 }}{% endif %}'
             '{% if messages[0].content == "bomb" %}{{ "x" * 4000000000 }}{% endif %}'
             '{% if messages[0].content == "no" %}{{ raise_exception("no thanks") }}{% endif %}'
             + TEMPLATE)
    worker = TemplateWorker(gated, SPECIALS, seconds=1.0, memory_bytes=1 << 30)
    yield worker
    worker.close()


def test_it_renders_what_the_template_renders_in_process(worker):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\ud7ff"}]
    in_process = ChatTemplate(TEMPLATE, SPECIALS)
    assert worker.render(messages) == in_process.render(messages)
    assert worker.render(messages, add_generation_prompt=False) == \
        in_process.render(messages, add_generation_prompt=False)


@pytest.mark.parametrize(("content", "reason"), [
    ("spin", "did not render these messages within 1 s"),
    ("huge", "rendered 2,000,0"),
    ("bomb", "MemoryError"),
    ("no", "no thanks"),
])
def test_a_hostile_render_fails_alone_within_the_limit(worker, content, reason):
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=reason):
        worker.render([{"role": "user", "content": content}])
    assert time.monotonic() - start < 8  # a cold start, then at most the 1 s limit
    assert worker.render([{"role": "user", "content": "ok"}]) == "<s><user>ok<assistant>"


def test_a_looping_render_does_not_hold_up_other_renders(worker):
    worker.render([{"role": "user", "content": "warm"}])  # both children started below
    spinning = threading.Thread(target=lambda: pytest.raises(
        ChatTemplateError, worker.render, [{"role": "user", "content": "spin"}]))
    spinning.start()
    time.sleep(0.2)
    start = time.monotonic()
    for _ in range(20):
        assert worker.render([{"role": "user", "content": "ok"}]).endswith("ok<assistant>")
    assert time.monotonic() - start < 5
    spinning.join(timeout=10)
    assert not spinning.is_alive()


def test_one_clients_burst_of_looping_renders_does_not_queue_ahead_of_another(worker):
    """Eight looping renders from one client (1 s each, two children) would hold a render
    that came after them for four rounds, first come first served; the other client's
    render gets the first child that comes free."""
    worker.render([{"role": "user", "content": "warm"}])
    hogs = [threading.Thread(target=lambda: pytest.raises(
        ChatTemplateError, worker.render, [{"role": "user", "content": "spin"}],
        client="hog")) for _ in range(8)]
    for hog in hogs:
        hog.start()
    time.sleep(0.3)
    start = time.monotonic()
    assert worker.render([{"role": "user", "content": "ok"}], client="other") == \
        "<s><user>ok<assistant>"
    assert time.monotonic() - start < 2.5  # one render's limit and a child's restart
    for hog in hogs:
        hog.join(timeout=30)
        assert not hog.is_alive()


@pytest.mark.parametrize(("template", "reason"), [
    (SPIN + TEMPLATE, "cannot render one user message: the chat template did not render"),
    ("{% for %}", "does not parse"),
    ("{{ messages[5].content }}", "cannot render one user message"),
])
def test_check_refuses_a_template_that_cannot_serve_within_limits(template, reason):
    worker = TemplateWorker(template, SPECIALS, seconds=0.5)
    try:
        with pytest.raises(CheckpointError, match=reason):
            worker.check()
    finally:
        worker.close()


PARENT = """
import sys, threading
from lathe.data.template_worker import TemplateWorker
worker = TemplateWorker(sys.argv[1], {}, seconds=600)
threading.Thread(target=worker.render, args=([{"role": "user", "content": "x"}],),
                 daemon=True).start()
threading.Event().wait()
"""


def test_a_busy_child_dies_with_its_parent():
    """A child stuck in a render never reads the end of its input: killed with SIGKILL, its
    parent must not leave it spinning on as an orphan."""
    import os
    import signal
    import subprocess
    import sys

    parent = subprocess.Popen([sys.executable, "-c", PARENT, SPIN])
    try:
        deadline = time.monotonic() + 30
        children: list[int] = []
        while not children:
            assert time.monotonic() < deadline, "the parent started no child"
            time.sleep(0.2)
            found = subprocess.run(["pgrep", "-P", str(parent.pid)], capture_output=True,
                                   text=True).stdout.split()
            children = [int(pid) for pid in found]
        time.sleep(1.0)  # the child takes the render and spins
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 1.0
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in children if _alive(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "a template worker outlived its parent by more than a second"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_child_started_from_a_thread_that_ended_keeps_serving(worker):
    """Children are started from short-lived threads (a request's, a tool pool's): one must
    outlive the thread that started it (PR_SET_PDEATHSIG killed it with that thread)."""
    first = threading.Thread(target=worker.render, args=([{"role": "user", "content": "a"}],))
    first.start()
    first.join()
    time.sleep(0.5)
    assert worker.render([{"role": "user", "content": "b"}]) == "<s><user>b<assistant>"


def test_a_child_that_died_between_calls_fails_one_call_and_is_replaced(worker):
    import os
    import signal
    import subprocess

    worker.render([{"role": "user", "content": "a"}])
    for pid in subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "template_worker"],
                              capture_output=True, text=True).stdout.split():
        os.kill(int(pid), signal.SIGKILL)
    time.sleep(0.2)
    outcomes = []
    for _ in range(3):  # a dead child's call fails as an error (not a BrokenPipeError)
        try:
            outcomes.append(worker.render([{"role": "user", "content": "b"}]))
        except ChatTemplateError as error:
            outcomes.append(str(error))
    assert outcomes[-1] == "<s><user>b<assistant>"
