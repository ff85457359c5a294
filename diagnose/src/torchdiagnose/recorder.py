"""What torch itself knows of this rank's collectives: each group's count of collectives issued, and the flight
recorder's entries (which are still running, which came last), with each group's mesh name and global ranks."""
import pickle
import time


def groups():
    from torch.distributed import distributed_c10d as c10d
    return list(c10d._world.pg_names)


def counts():
    """Each live group's count of collectives issued: the watchdog looks at the recorder only when these stand
    still."""
    found = []
    for group in groups():
        try:
            found.append(group._get_sequence_number_for_group())
        except Exception:  # noqa: BLE001  a group being destroyed: counted as unknown, the others still watched
            found.append(None)
    return found


def read(with_stacks=False, only_active=False):
    """torch's flight recorder, read (a dict with 'entries'); None where it is off or this torch has none."""
    import torch
    try:
        return pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, with_stacks, only_active))
    except Exception:  # noqa: BLE001  the recorder off, or unreadable: the line says less, the job goes on
        return None


def group_ranks():
    """{group name: (its description, its global ranks, sorted)}, for this process's live groups: the line names a
    DeviceMesh's group by its dimension ("mesh_tp") and ranks (gloo's flight recorder keeps neither)."""
    from torch.distributed import distributed_c10d as c10d
    world = c10d._world
    return {str(name): (getattr(group, "group_desc", "") or "", sorted(world.pg_group_ranks.get(group) or ()))
            for group, name in list(world.pg_names.items())}


def running_collectives(dump=None):
    """The collectives of this process still running, oldest first: (seconds waited, flight recorder entry)."""
    dump = dump if dump is not None else read(only_active=True)
    now = time.time_ns()
    found = [((now - e["time_created_ns"]) / 1e9, e) for e in (dump or {}).get("entries", [])
             if not e.get("retired") and e.get("time_created_ns")]
    return sorted(found, key=lambda item: -item[0])


def last_collective(dump):
    """The newest collective in the flight recorder, of any group (its entry): where a rank's error came from, its
    last collective (a DeviceMesh's, or the default group's); None without one."""
    entries = [e for e in (dump or {}).get("entries", []) if e.get("time_created_ns")]
    return max(entries, key=lambda e: e["time_created_ns"]) if entries else None
