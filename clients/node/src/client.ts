// A typed gRPC client of any service of the generated stubs: each method of
// the protobuf-es service descriptor becomes a function of the client, named as
// in the descriptor (`match`, `publishEventsStream`, ...), whose requests and
// responses are the generated message types. The transport is @grpc/grpc-js;
// the messages cross it as protobuf-es binary (toBinary / fromBinary).

import * as grpc from '@grpc/grpc-js';
import { create, fromBinary, isMessage, toBinary } from '@bufbuild/protobuf';
import type { DescMessage, DescMethod, DescService, MessageInitShape, MessageShape } from '@bufbuild/protobuf';
import { channelTarget, connection, type ConnectionOptions } from './connection';

/** Deadline of a unary call when the caller gives none. */
export const DEFAULT_UNARY_DEADLINE_MS = 5000;

/** Per-call options. */
export interface CallOptions {
  /** Bound on the call; unary calls default to DEFAULT_UNARY_DEADLINE_MS, streams to none. */
  deadlineMs?: number;
  /** Request metadata. */
  metadata?: grpc.Metadata;
}

/** A message to send: the generated message, or a plain object of its fields (`create` fills the rest). */
export type Request<I extends DescMessage> = MessageInitShape<I>;

/** A client-streaming call: write requests to `call`, end it, and await `response`. */
export interface ClientStreamingCall<I extends DescMessage, O extends DescMessage> {
  call: grpc.ClientWritableStream<Request<I>>;
  response: Promise<MessageShape<O>>;
}

type In<M> = M extends { input: infer I extends DescMessage } ? I : never;
type Out<M> = M extends { output: infer O extends DescMessage } ? O : never;

/** The function a method of the descriptor becomes. */
export type MethodCall<M> = M extends { methodKind: 'unary' }
  ? (request: Request<In<M>>, options?: CallOptions) => Promise<MessageShape<Out<M>>>
  : M extends { methodKind: 'server_streaming' }
    ? (request: Request<In<M>>, options?: CallOptions) => grpc.ClientReadableStream<MessageShape<Out<M>>>
    : M extends { methodKind: 'client_streaming' }
      ? (options?: CallOptions) => ClientStreamingCall<In<M>, Out<M>>
      : M extends { methodKind: 'bidi_streaming' }
        ? (options?: CallOptions) => grpc.ClientDuplexStream<Request<In<M>>, MessageShape<Out<M>>>
        : never;

/** A client of `S`: one function per method, plus the channel's own. */
export type ServiceClient<S extends DescService> = {
  readonly [K in keyof S['method']]: MethodCall<S['method'][K]>;
} & {
  /** The grpc-js client underneath (its channel, `getChannel()`, ...). */
  readonly grpcClient: grpc.Client;
  /** Close the channel. */
  close(): void;
  /** Resolve when the channel is connected, reject after `deadlineMs`. */
  waitForReady(deadlineMs?: number): Promise<void>;
};

/** protobuf-es binary of `value` (a message of `schema`, or the fields to create one from). */
function serializer<I extends DescMessage>(schema: I): (value: Request<I>) => Buffer {
  return (value) => {
    const message = isMessage(value, schema) ? value : create(schema, value);
    const bytes = toBinary(schema, message);
    return Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  };
}

function deserializer<O extends DescMessage>(schema: O): (bytes: Buffer) => MessageShape<O> {
  return (bytes) => fromBinary(schema, bytes);
}

function callOptions(options: CallOptions | undefined, defaultDeadlineMs: number | null): grpc.CallOptions {
  const deadlineMs = options?.deadlineMs ?? defaultDeadlineMs;
  return deadlineMs == null ? {} : { deadline: Date.now() + deadlineMs };
}

/** The function `method` becomes on a client over `raw`. */
function bind(raw: grpc.Client, service: DescService, method: DescMethod): unknown {
  const path = `/${service.typeName}/${method.name}`;
  const serialize = serializer(method.input);
  const deserialize = deserializer(method.output);
  switch (method.methodKind) {
    case 'unary':
      return (request: Request<DescMessage>, options?: CallOptions) =>
        new Promise((resolve, reject) => {
          raw.makeUnaryRequest(
            path,
            serialize,
            deserialize,
            request,
            options?.metadata ?? new grpc.Metadata(),
            callOptions(options, DEFAULT_UNARY_DEADLINE_MS),
            (err, res) => (err ? reject(err) : resolve(res)),
          );
        });
    case 'server_streaming':
      return (request: Request<DescMessage>, options?: CallOptions) =>
        raw.makeServerStreamRequest(
          path,
          serialize,
          deserialize,
          request,
          options?.metadata ?? new grpc.Metadata(),
          callOptions(options, null),
        );
    case 'client_streaming':
      return (options?: CallOptions) => {
        let call!: grpc.ClientWritableStream<Request<DescMessage>>;
        const response = new Promise((resolve, reject) => {
          call = raw.makeClientStreamRequest(
            path,
            serialize,
            deserialize,
            options?.metadata ?? new grpc.Metadata(),
            callOptions(options, null),
            (err, res) => (err ? reject(err) : resolve(res)),
          );
        });
        return { call, response };
      };
    case 'bidi_streaming':
      return (options?: CallOptions) =>
        raw.makeBidiStreamRequest(
          path,
          serialize,
          deserialize,
          options?.metadata ?? new grpc.Metadata(),
          callOptions(options, null),
        );
  }
}

/**
 * A client of `service` (a service descriptor of the generated stubs, e.g.
 * `IndexerService`) at `address`: `host:port`, `dns:///name:port`, or several
 * replica addresses (`channelTarget`); `options` as for `connection`.
 */
export function serviceClient<S extends DescService>(
  service: S,
  address: string | readonly string[],
  options: ConnectionOptions = {},
): ServiceClient<S> {
  const { credentials, channelOptions } = connection(options);
  const raw = new grpc.Client(channelTarget(address), credentials, channelOptions);
  const client: Record<string, unknown> = {
    grpcClient: raw,
    close: () => raw.close(),
    waitForReady: (deadlineMs = DEFAULT_UNARY_DEADLINE_MS) =>
      new Promise<void>((resolve, reject) =>
        raw.waitForReady(Date.now() + deadlineMs, (err) => (err ? reject(err) : resolve())),
      ),
  };
  for (const method of service.methods) {
    if (method.localName in client) {
      throw new Error(`${service.typeName}.${method.name} clashes with the client's own ${method.localName}`);
    }
    client[method.localName] = bind(raw, service, method);
  }
  return client as ServiceClient<S>;
}
