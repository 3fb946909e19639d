"""Lab 8 verdicts: right answers pass, plausible mistakes fail with a reason, stubs say TODO."""

import dataclasses

from grader_harness import mistakes_fail, reference_passes, same_verdict_every_run, stubs_are_todo

# Task 8.1 --------------------------------------------------------------------------------------


def ops_with(*, pinned=True, free_home=True, share_home=False, restore=True, wait_compute=True, into_data=True,
             on_h2d=True, event=True, record_after=True, record_on_h2d=True, fetch_waits=False, wait_arrived=True,
             free=True, resize_only=False, release_syncs=False):
    """A correct (send_home, fetch, release), with switches that turn it into one plausible mistake at a time."""
    def send_home(dev, params):
        homes = []
        for p in params:
            if share_home:
                home = p.detach().cpu()  # on the sim, the parameter's own memory
            else:
                home = dev.host_empty(tuple(p.shape), p.dtype, pinned=pinned)
                home.copy_(p.detach())
            if free_home:
                dev.free_storage(p)
            homes.append(home)
        return homes

    def fetch(dev, params, homes, h2d):
        for p in params:
            if restore:
                dev.restore_storage(p, "streamed weight")
        if wait_compute:
            dev.stream_waits_for_compute(h2d)
        arrived = dev.event()
        if not record_after:
            arrived.record(h2d)
        for p, home in zip(params, homes, strict=True):
            dev.copy(p.data if into_data else p, home, h2d if on_h2d else None)
        if record_after and event:
            arrived.record(h2d if record_on_h2d else dev.default_stream)
        if fetch_waits:
            dev.compute_waits_for(arrived)
        return arrived if event else None

    def release(dev, params, arrived):
        if release_syncs:
            dev.synchronize()
        elif wait_arrived:
            dev.compute_waits_for(arrived)
        for p in params:
            if resize_only:
                p.untyped_storage().resize_(0)
            elif free:
                dev.free_storage(p)

    return lambda: (send_home, fetch, release)


# Task 8.2 --------------------------------------------------------------------------------------

def queue_with(*, wrap=True, cap=True, uses=False, unique=False, shift=0, reverse=False):
    def upcoming(order, pos, prefetch):
        n = len(order)
        count = min(prefetch, n) if cap else prefetch
        start = pos + shift
        if wrap:
            picked = [order[(start + j) % n] for j in range(count)]
        else:
            picked = order[start:start + count]
        blocks = picked if uses else [block for _, block in picked]
        if unique:
            blocks = list(dict.fromkeys(blocks))
        return blocks[::-1] if reverse else blocks
    return upcoming


# Task 8.3 --------------------------------------------------------------------------------------

def budget_with(*, times_largest=False, first_only=False, no_self=False, cyclic=False, equal_refused=False,
                no_numbers=False, error=ValueError, returns=False):
    def smallest_budget(block_bytes, prefetch):
        n = len(block_bytes)
        if times_largest:
            return max(block_bytes) * (prefetch + 1)
        width = prefetch if no_self else prefetch + 1
        if first_only:
            return sum(block_bytes[:width])
        if cyclic:
            return max(sum(block_bytes[(i + j) % n] for j in range(min(width, n))) for i in range(n))
        return max(sum(block_bytes[i:i + width]) for i in range(n))

    def check_budget(block_bytes, prefetch, budget_bytes):
        need = smallest_budget(block_bytes, prefetch)
        if budget_bytes < need or (equal_refused and budget_bytes == need):
            if returns:
                return False
            raise error("budget too small" if no_numbers else
                        f"budget_bytes={budget_bytes:,} is below the {need:,} bytes a block and its prefetches need")
        return None

    return lambda: (smallest_budget, check_budget)


# Task 8.4 --------------------------------------------------------------------------------------


def diagnose_with(*, always=None, profile_as_given=False, link_always=False, tokens_times=None, home_anyway=False,
                  extra_key=False):
    """A correct diagnosis, with switches that turn it into one plausible mistake at a time."""
    def rate(trace, lane):
        spans = [s for s in trace.on(lane) if s.nbytes]
        seconds = sum(s.duration for s in spans)
        return sum(s.nbytes for s in spans) / seconds if seconds else 0.0

    def diagnose_fetch(hw, run, predict):
        trace, work, config, limits = run["trace"], run["work"], run["config"], run["limits"]
        link, drive = rate(trace, "h2d"), rate(trace, "nvme_read")
        if always:
            cause = always
        elif link_always:
            cause = "link"
        elif drive and drive < 0.8 * hw.nvme_read:
            cause = "drive"
        elif link < 0.8 * hw.link_h2d:
            cause = "link"
        else:
            cause = "prefetch"
        believed = hw if profile_as_given else hw.replace(
            link_h2d=min(hw.link_h2d, link), nvme_read=min(hw.nvme_read, drive or hw.nvme_read))
        deepest = limits["max_prefetch"]
        fixes = [{"prefetch": k} for k in range(1, deepest + 1)]
        if limits["host_home"] or home_anyway:
            fixes.append({"params_on": "host", "prefetch": deepest})
        tokens = work.tokens
        if tokens_times and cause != "prefetch":  # a jump in tokens, the limit not read
            return cause, {"tokens": tokens * tokens_times, "prefetch": deepest}
        while tokens * 2 <= limits["max_tokens"]:
            tokens *= 2
            fixes.append({"tokens": tokens, "prefetch": deepest})
        for fix in fixes:
            home = fix.get("params_on", config.placement.params_on)
            tried = predict(believed, dataclasses.replace(work, tokens=fix.get("tokens", work.tokens)),
                            config.replace(prefetch=fix["prefetch"], params_on=home))
            if tried.exposed_fetch_s <= 0.04 * tried.step_s:
                if extra_key:
                    fix = dict(fix, micro_batch=2)
                return cause, fix
        return cause, fixes[-1]
    return diagnose_fetch


REFERENCE = {
    "8.4": diagnose_with(),
    "8.1": ops_with(),
    "8.2": queue_with(),
    "8.3": budget_with(),
}
WRONG = [  # (task, plausible mistake, what the verdict must mention)
    ("8.1", ops_with(pinned=False), "pageable host memory"),
    ("8.1", ops_with(free_home=False), "send_home left a weight"),
    ("8.1", ops_with(share_home=True), "shares the parameter's memory"),
    ("8.1", ops_with(restore=False), "dev.restore_storage(p)"),
    ("8.1", ops_with(wait_compute=False), "without dev.stream_waits_for_compute(h2d)"),
    ("8.1", ops_with(into_data=False), "Copy into p.data"),
    ("8.1", ops_with(on_h2d=False), "on stream 'default'"),
    ("8.1", ops_with(event=False), "expected the event recorded on h2d"),
    ("8.1", ops_with(record_after=False), "recorded its event before its copies"),
    ("8.1", ops_with(record_on_h2d=False), "not on h2d where the copies run"),
    ("8.1", ops_with(fetch_waits=True), "waiting there stalls that block"),
    ("8.1", ops_with(wait_arrived=False), "before its copy had landed"),
    ("8.1", ops_with(free=False), "release left a weight"),
    ("8.1", ops_with(resize_only=True), "the ledger still counts"),
    ("8.1", ops_with(release_syncs=True), "release waited with dev.synchronize()"),
    ("8.2", queue_with(wrap=False), "stopped at the end of the recorded order"),
    ("8.2", queue_with(cap=False), "at most one pass ahead"),
    ("8.2", queue_with(uses=True), "the second item of each use"),
    ("8.2", queue_with(unique=True), "one entry per use"),
    ("8.2", queue_with(shift=1), "is the next use"),
    ("8.2", queue_with(shift=-1), "the one running now"),
    ("8.2", queue_with(reverse=True), "in the order of their uses"),
    ("8.3", budget_with(times_largest=True), "not copies of the largest one"),
    ("8.3", budget_with(first_only=True), "not only at the first"),
    ("8.3", budget_with(no_self=True), "a block and the next"),
    ("8.3", budget_with(cyclic=True), "windows end at the last block"),
    ("8.3", budget_with(equal_refused=True), "equal included"),
    ("8.3", budget_with(no_numbers=True), "name the numbers"),
    ("8.3", budget_with(error=RuntimeError), "ParamStreamer refuses a budget with ValueError"),
    ("8.3", budget_with(returns=True), "instead of raising"),
    ("8.4", diagnose_with(always="prefetch"), "no prefetch depth makes the copies faster"),
    ("8.4", diagnose_with(link_always=True), "the link is as fast as planned"),
    ("8.4", diagnose_with(always="drive"), "no block is read from a drive"),
    ("8.4", diagnose_with(profile_as_given=True), "not as the profile says"),
    ("8.4", diagnose_with(tokens_times=8), "a micro-batch holds 1 to 16384 tokens"),
    ("8.4", diagnose_with(home_anyway=True), "this host's memory cannot hold the weights"),
    ("8.4", diagnose_with(extra_key=True), "a fix may change only"),
]

test_reference_passes = reference_passes(REFERENCE)
test_plausible_mistake_fails_with_a_reason = mistakes_fail(WRONG)
test_stub_is_todo = stubs_are_todo(REFERENCE)
test_verdicts_hold_no_timings = same_verdict_every_run(REFERENCE, ("8.1", "8.2", "8.3", "8.4"))
