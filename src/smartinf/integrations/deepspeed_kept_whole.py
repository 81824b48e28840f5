"""``KeptWhole``: ``SmartInfinityStage3``'s dealings with DeepSpeed's kept-whole (persistent)
params, the small ones ZeRO-3 keeps gathered between steps: released and gathered again
around the step only where their gathered copy is not their partition (at one rank it is,
and releasing them cost 19 ms of 7 B's step), their copies' edits written into their
partitions, and released after a failure so that the next gather takes the restored ones."""
from __future__ import annotations

from typing import Any

from deepspeed import comm as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus


def gathered_as_partition(p: Any) -> bool:
    """A param gathered whole whose data is its partition's memory (DeepSpeed's gather at
    one rank, the partition on the param's device)."""
    return p.ds_status == ZeroParamStatus.AVAILABLE and p.ds_tensor is not None and \
        p.ds_tensor.numel() == p.ds_numel == p.data.numel() and \
        p.data.data_ptr() == p.ds_tensor.data_ptr() and p.data.device == p.ds_tensor.device


class KeptWhole:
    """The kept-whole params' side of ``SmartInfinityStage3`` (``self._whole``: the
    digests of the copies apart from their partitions, ``StoredStates._open``)."""

    def _release_for_step(self) -> None:
        """DeepSpeed's ``_partition_all_parameters`` (every param released before the step,
        the kept-whole ones gathered again by ``_post_step``), less the kept-whole params
        whose gathered data is their partition: at world 1 with the partitions on the
        params' device, DeepSpeed's gather is a view (``_no_gather_coalesced``), so the
        step's update reaches them where they are, and releasing and gathering them again
        changes no value. It took 19 ms of 7 B's step (lease m), and the gather a
        synchronize. Anything else still gathered: DeepSpeed's, whole."""
        persistent = {id(p) for p in self.persistent_parameters}
        params = list(self.module.parameters())
        if all(gathered_as_partition(p) if id(p) in persistent
               else getattr(p, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE for p in params):
            for p in params:
                p.ds_active_sub_modules.clear()  # (as DeepSpeed's release does)
        else:
            self._partition_all_parameters()

    def _kept_whole_edits(self) -> list:
        """The kept-whole params whose gathered copies the caller changed since recorded,
        written into their partitions here, as DeepSpeed's ``partition(has_been_updated=True)``
        would. One apart from its partition with no record was its partition when recorded:
        its data was replaced since (``p.data = ...``), an edit too."""
        whole = [p for p in self._kept_apart() if p.data.numel() == p.ds_numel]
        copied = self._whole.changed(whole, unrecorded=True)
        for p in copied:  # (one partitioned since holds its edits there)
            part, flat = p.ds_tensor, p.data.reshape(-1)
            start = part.ds_numel * dist.get_rank(group=self.dp_process_group)
            count = max(0, min(part.ds_numel, p.ds_numel - start))
            part.narrow(0, 0, count).copy_(flat.narrow(0, start, count))
        return copied

    def _kept_apart(self) -> list:
        """The kept-whole params whose gathered copy is not their partition: an edit of
        theirs is told from what it held when gathered (the others' edits are their
        partitions', which ``_watch`` or a split master's devices tell)."""
        return [p for p in self.persistent_parameters if not gathered_as_partition(p)]

    def _record_kept_whole(self) -> None:
        """What the kept-whole params apart from their partitions hold now, what an edit of
        theirs is told from (the others have no record: ``_kept_whole_edits``)."""
        self._whole.forget(self.persistent_parameters)
        self._whole.record_all(self._kept_apart())

    def _regather_persistent(self) -> None:
        """The kept-whole params gathered again from their partitions: an all-gather skips
        params still gathered, so they are released first."""
        if self.persistent_parameters:
            self.persistent_parameters[0].partition(self.persistent_parameters)
            self.persistent_parameters[0].all_gather(self.persistent_parameters)
        self._record_kept_whole()

    def _release_kept_whole(self, restored: list) -> None:
        """After a failure, the kept-whole params' gathered copies hold the failed step's
        values: released (a local operation), so the next gather (the forward's, a
        ``GatheredParameters``) takes them from the restored partitions."""
        if set(restored) & set(self._persistent_subgroups):
            self.persistent_parameters[0].partition(self.persistent_parameters)
