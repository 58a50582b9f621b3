//! gpud's wire contract: the request and response types both gpud and gpuctl use.
