"""Drafters ("proposers"): the public ``HostDrafter`` base class, the n-gram drafters, the draft model's
host half, and the factory that is the only place a drafter kind is named."""
