"""What must let go of the process group before destroy_process_group, for a clean exit (docs/failures.md).

destroy_process_group frees the group only if nothing else holds it. Whatever still does (a DDP model, FSDP's
modules, DTensor's caches, a save thread) tears it down later: with the GIL held when the holder goes (a hang,
now and then), or during interpreter shutdown, where a gloo thread finishing a collective is ended by Python and
aborts the process ("terminate called without an active exception", SIGABRT) after the run has finished.
The scripts drop their own references (`del trainer, model, optimizer`); these are the ones they cannot see.

The same family has one more member that every DDP script guards against in its own lines: torch.distributed.nn
gives its functions `group=group.WORLD` as default arguments, and DDP's constructor imports it lazily; imported
then, those defaults hold the live group for good. So the scripts import it first, before any process group.
"""
import gc
import threading


def join_save_threads():
    """Wait until DCP's async save thread has exited. Its future is done before the thread lets go of the save's
    arguments (the staged state, whose DTensors hold the device mesh and its groups, and the checkpoints' group):
    a destroy_process_group in that moment would leave the groups alive, to be torn down later, by the save
    thread or at exit. dcp.async_save shuts its one-thread executor down as soon as the save is done, so the
    thread ends. (torch 2.13 names the thread AsyncCheckpointExecutor...)"""
    for thread in threading.enumerate():
        if thread.name.startswith("AsyncCheckpointExecutor") and thread is not threading.current_thread():
            thread.join()


def release_fsdp(mesh):
    """Once the sharded model and optimizer are deleted: FSDP2's modules sit in reference cycles (the module's
    hooks hold FSDP's state, which holds the module) that only the garbage collector frees; and DTensor's caches
    (sharding propagation, redistribution plans) keep the device mesh for good, which holds its groups."""
    gc.collect()
    mesh._pg_registry.clear()  # private: torch 2.13 has no public way to let a mesh go of its groups


def release_trainer(trainer):
    """A Hugging Face Trainer's DDP wrapper (the Trainer and accelerate both hold it). Whoever drops the group last
    waits for gloo's worker threads, and one of them may still need the GIL to free a finished collective's
    tensors: destroy_process_group waits without the GIL, a DDP wrapper freed after it waits holding it, and the
    process hangs now and then."""
    trainer.accelerator.free_memory()
    trainer.model_wrapped = trainer.model
    gc.collect()
