"""The parameter server: shard loop (:mod:`.server`), replica side (:mod:`.client`), waiting."""
