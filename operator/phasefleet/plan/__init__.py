"""Fleet planning: a discrete-event simulator of our fleets and `phasefleet plan`, which sizes a
service for a request trace and an SLO."""
