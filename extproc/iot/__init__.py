"""The IoT adapter (route kind `iot`, docs/iot-adapter.md): device commands as MQTT messages.

- `topics.py`: topic templates (`plant/{$.device}/set`): placeholders are template paths, rendered
  values checked so a client cannot inject topic levels or wildcards;
- `commands.py`: a route's `iot` block compiled once per config load (`IotRoute`, `Command`);
- `client.py`: the worker's MQTT connections (`MqttClients`, held by the runtime, kept across reloads):
  QoS 1 publish, reply subscriptions, replies matched to requests by correlation id.
The stages that use them: `extproc/stages/mqtt_command.py` (the command in the request) and
`extproc/stages/mqtt_model_command.py` (the optional LLM step: the command in a model's answer).
"""
