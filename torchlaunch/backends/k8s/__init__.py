"""The Kubernetes backend: manifests rendered as pure data; the pods run the local backend's launcher.

launch: argv -> JobSpec and K8sOptions -> YAML (`python -m launch.k8s`); options: K8sOptions and the check
of every value; manifest: the Indexed Job (+ headless Service, PVC) or JobSet manifests as dicts;
elastic: the elastic variant's rendezvous wiring; validate: what the API server would reject, refused
before rendering; operate: kubectl for state, logs and cancel (printed where no cluster answers).
"""
