"""The bundled torch engine."""
