"""A worker whose role can change in place: `splitserve worker --role prefill|decode|both` (see :mod:`.main`)."""
