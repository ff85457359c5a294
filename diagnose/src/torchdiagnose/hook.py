"""Imported at start-up by every Python process of a job under torchdiagnose: torchdiagnose-hook.pth, which the
wheel puts in site-packages, imports it where the prefix set DIAGNOSE_TIMEOUT (elsewhere the .pth line costs one
look at the environment). It imports nothing heavy (torch is not imported here) and arms torchdiagnose.rank, which
patches torch.distributed once the script imports it. Nothing is put on sys.path."""
import os


def _arm():
    try:
        from torchdiagnose import rank
        rank.arm()
    except Exception as error:  # noqa: BLE001  a tool that cannot arm must not stop the job: say so, run without it
        os.write(2, f"diagnose: not watching this process ({type(error).__name__}: {error})\n".encode())


_arm()
