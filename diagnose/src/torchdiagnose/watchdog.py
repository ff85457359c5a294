"""The one thread this tool adds to a rank: every POLL_S it looks whether a collective (or a point-to-point op)
waits longer than --timeout, then asks the others, and whether another rank has asked, then answers. leave()
stops it before the default group goes."""
import time
from datetime import timedelta

from torchdiagnose import ask, names, parallel, recorder
from torchdiagnose.state import STATE, timeout_s
from torchdiagnose.view import main_frame

POLL_S = 0.5  # how often the watchdog looks at the groups' counts, and whether another rank asks
LEAVE_S = 2.0  # the longest a rank that ends waits for the others to end too (see leave)


def watch():
    """The watchdog thread's loop, until a question, or until the default group goes."""
    import torch.distributed as dist
    limit = timeout_s()
    counts, next_look, asked = None, 0.0, False
    while not STATE.round:
        time.sleep(POLL_S)
        with STATE.lock:
            if STATE.closing or not dist.is_initialized():
                return
            current = recorder.counts()
            try:
                asked = STATE.store.check([names.ROUND])
            except Exception:  # noqa: BLE001  the store went (its host ended): nothing more to watch, the job goes on
                return
        if asked:
            return ask.answer()
        now = time.monotonic()
        if current != counts:  # collectives complete: nothing to look at
            counts, next_look = current, now + min(limit, 2.0)
            continue
        if now < next_look:
            continue
        running = recorder.running_collectives()
        if not running:  # no collective: a point-to-point op (not in gloo's flight recorder) the rank waits on?
            blocked = parallel.blocked(main_frame())
            if blocked is None:
                # nothing runs: this rank is in its own code until a count moves (or until a p2p op it issued
                # and has not waited on yet holds it)
                next_look = now + min(limit, 2.0) if parallel.pending() else float("inf")
                continue
            running = [blocked]
        waited = running[0][0]
        if waited < limit:
            next_look = now + (limit - waited)
            continue
        question = ask.ask("timeout", waited)
        if question is not None:
            ask.finish(question)


def leave():
    """Before the default group goes (destroy_process_group, or the end of the process): stop the watchdog, say
    so in the store, and wait (at most LEAVE_S) until every rank has: the rank that hosts the store must not
    take it away while another still looks at it (TCPStore prints a C++ backtrace for each such look). Then
    let go of this tool's store client before torch tears the group down."""
    parallel.stop()
    with STATE.lock:
        if STATE.closing or STATE.store is None:
            STATE.closing = True
            return
        STATE.closing = True
    import torch.distributed as dist
    try:
        if not STATE.round:
            # The last to arrive posts a key that the store hands to every waiting rank at once: a rank that
            # polled instead could be reading when the store's host, done waiting, takes it away.
            if STATE.store.add(names.LEFT, 1) >= dist.get_world_size():
                STATE.store.set(names.ALL_LEFT, "")
            else:
                STATE.store.wait([names.ALL_LEFT], timedelta(seconds=LEAVE_S))
    except Exception:  # noqa: BLE001  the store is gone already, or the others took too long: leave all the same
        pass
    STATE.store = None
