"""kvcore's control plane for shell users: ``kvctl`` (inspect and steer the instances on a
GPU) and ``kvtop`` (a live view). Both read and write the per-GPU ledgers of
``kvcore.budget.ledger`` (``GpuLedger``)."""
