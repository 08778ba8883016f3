"""torch's older home of FSDP2 (`_composable` in torch's distributed package); only `fsdp` is aliased here."""
