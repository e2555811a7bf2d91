"""The locoswarm peer: inner training, outer algorithms, transports, CLI."""

import os as _os

# Tensors the peer's processes pass each other (the averager's buffers, the residuals a checkpoint
# fetches) go through torch's shared memory with the strategy hivemind reads from this variable
# when it is imported (hivemind/utils/mpfuture.py; its default is "file_system"). With
# "file_system" each is a named file in /dev/shm that only its last user removes, so a process
# that is killed while it holds one (kill -9, the OOM killer, the SIGKILL a helper gets when the
# peer's main process dies) leaves it there: memory gone until a reboot. With "file_descriptor"
# the file is unlinked as soon as it is made and the kernel frees it with the last process that
# maps it. A user's own setting is kept.
_os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")
