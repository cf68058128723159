"""jax.lax's collectives computed by jaxcomm (``jaxcomm.lax``) and the switch that routes
``jax.lax``'s own names there (``jaxcomm.use_for_lax``)."""
