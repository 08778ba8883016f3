"""torch's older home of FSDP2 (`torch.distributed._composable`); only its `fsdp` package is aliased here."""
