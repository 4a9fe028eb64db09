"""The Kubernetes backend: manifests rendered as pure data; the pods run the local backend's launcher.

launch: JobSpec -> Indexed Job (+ headless Service, PVC) or JobSet manifests (`python -m launch.k8s`);
elastic: the elastic variant's rendezvous wiring; validate: what the API server would reject, refused
before rendering; operate: kubectl for state, logs and cancel (printed where no cluster answers).
"""
