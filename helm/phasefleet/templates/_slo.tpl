{{/*
An SLO target as the histograms' le label writes it (Python's prometheus_client: "1.0", not
"1"): a string is kept, a number gets its ".0" back when it has no fraction.
*/}}
{{- define "phasefleet.le" -}}
{{- $le := toString . -}}
{{- if and (not (kindIs "string" .)) (not (contains "." $le)) -}}
{{- $le = printf "%s.0" $le -}}
{{- end -}}
{{- $le -}}
{{- end -}}
