"""kvxfer.worker: the prefill/decode worker process (``kvxfer serve``)."""
